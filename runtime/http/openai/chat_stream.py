"""Streaming one chat choice with reasoning and tool calls split out of its text, in OpenAI's delta shapes.

Each engine chunk's text is appended and the whole text is split again (outputs are short next to the cost of
generating them); what was not sent yet goes out as `reasoning_content`, `content` and `tool_calls` deltas.
Text that may still turn out to be a tool call (from the parser's start marker on, or a tail that could grow
into it) is held back from `content`. A call goes out as OpenAI streams one: a delta with its index, id, type and
name (arguments ""), then deltas with pieces of its arguments text. In the JSON formats the name goes out as soon
as the call's head is written and the arguments as they grow (tool_parsers/partial.py), so a call cut off by
max_tokens still reaches the client as a call, not as raw text; in the others a call goes out once it parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan
from radixserve.runtime.http.openai.tool_parsers import ToolCall
from radixserve.runtime.http.openai.tool_parsers.base import new_call_id
from radixserve.runtime.http.openai.tool_parsers.partial import PartialCall


@dataclass
class SentCall:
    """A call as far as the stream has sent it."""

    id: str
    name: str
    arguments: str = ""


class ChoiceStream:
    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.calls: list[SentCall] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas that `text`, the choice's next piece, makes ready (all the rest once `finished`)."""
        self.text += text
        content = self.text
        deltas: list[dict[str, Any]] = []
        if self.plan.reasoning_parser is not None:
            split = self.plan.reasoning_parser.split(self.text, finished)
            if len(split.reasoning) > self.sent_reasoning:
                deltas.append({"reasoning_content": split.reasoning[self.sent_reasoning:]})
                self.sent_reasoning = len(split.reasoning)
            content = split.content
        visible, calls, partials = self._visible(content, finished)
        if len(visible) > self.sent_content:
            deltas.append({"content": visible[self.sent_content:]})
            self.sent_content = len(visible)
        return deltas + self._call_deltas(calls, partials)

    def _visible(self, content: str, finished: bool) -> tuple[str, list[ToolCall], list[PartialCall]]:
        """The content that may be shown now, the calls complete so far, and the calls begun so far."""
        parser = self.plan.tool_parser
        if parser is None:
            return content, [], []
        start = parser.call_start(content)
        partials = parser.partial_calls(content)
        if finished:
            parsed = parser.parse(content)
            if not parsed.calls and self.calls:  # cut off (max_tokens) inside a call whose name went out
                return content[:start], [], partials
            return (parsed.content if parsed.content.strip() or not parsed.calls else ""), parsed.calls, partials
        if start < len(content):
            return content[:start], parser.settled_calls(content), partials
        return content[:len(content) - parser.may_start_later(content)], [], []

    def _call_deltas(self, calls: list[ToolCall], partials: list[PartialCall]) -> list[dict[str, Any]]:
        """Deltas for what is new in the calls: a header per new call, then its arguments text beyond what was
        sent. The arguments go out as the model wrote them; a parsed call without a partial view of its text
        (not a JSON format) sends its arguments whole."""
        deltas: list[dict[str, Any]] = []
        for index in range(max(len(calls), len(partials))):
            call: Optional[ToolCall] = calls[index] if index < len(calls) else None
            partial = partials[index] if index < len(partials) else None
            if index == len(self.calls):
                self.calls.append(SentCall(call.id if call else new_call_id(), call.name if call else partial.name))
                sent = self.calls[index]
                deltas.append({"tool_calls": [{"index": index, "id": sent.id, "type": "function",
                                               "function": {"name": sent.name, "arguments": ""}}]})
            sent = self.calls[index]
            if partial is not None and partial.name == sent.name:
                arguments = partial.arguments
            elif call is not None and not sent.arguments:
                arguments = call.arguments
            else:
                continue
            if len(arguments) > len(sent.arguments) and arguments.startswith(sent.arguments):
                deltas.append({"tool_calls": [{"index": index,
                                               "function": {"arguments": arguments[len(sent.arguments):]}}]})
                sent.arguments = arguments
        return deltas
