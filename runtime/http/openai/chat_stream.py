"""Streaming one chat choice with reasoning and tool calls split out of its text, in OpenAI's delta shapes.

Each engine chunk's text is appended and the whole text is split again (outputs are short next to the cost of
generating them); what was not sent yet goes out as `reasoning_content`, `content` and `tool_calls` deltas.
Text that may still turn out to be a tool call (from the parser's start marker on, or a tail that could grow
into it) is held back until the calls in it parse or the output ends; a completed call goes out as OpenAI
streams one: a delta with its index, id, type and name (arguments ""), then one with its arguments text.
"""

from __future__ import annotations

from typing import Any

from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan
from radixserve.runtime.http.openai.tool_parsers import ToolCall


class ChoiceStream:
    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.calls: list[ToolCall] = []

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
        visible, calls = self._visible(content, finished)
        if len(visible) > self.sent_content:
            deltas.append({"content": visible[self.sent_content:]})
            self.sent_content = len(visible)
        for call in calls[len(self.calls):]:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas

    def _visible(self, content: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The content that may be shown now, and the calls complete so far."""
        parser = self.plan.tool_parser
        if parser is None:
            return content, []
        start = parser.call_start(content)
        if finished:
            parsed = parser.parse(content)
            return (parsed.content if parsed.content.strip() or not parsed.calls else ""), parsed.calls
        if start < len(content):
            return content[:start], parser.settled_calls(content)
        return content[:len(content) - parser.may_start_later(content)], []
