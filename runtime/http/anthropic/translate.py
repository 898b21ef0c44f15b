"""A Messages request as the chat route's request: one conversation, the same template, tools and reasoning.

`system` becomes the system message; an assistant's `tool_use` blocks its tool calls (the input written as JSON
arguments), its `thinking` its reasoning content; each `tool_result` a tool message answering its call (an error
result says so in its text). `tool_choice` maps onto OpenAI's: auto -> auto, any -> required, tool -> the named
function, none -> none, `disable_parallel_tool_use` -> parallel_tool_calls false. A last message of the assistant
is a prefill: the answer continues it. `thinking: disabled` tells the
template not to think (`enable_thinking: false`, Qwen 3's switch; other templates ignore it). The chat route's
checks (tool schemas, the parser the server runs, the sampling values) then hold for Messages requests as well.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import orjson
import pydantic

from radixserve.runtime.http.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from radixserve.runtime.http.errors import APIError, validation_error
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def _conversation(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += _user_turns(message) if message.role == "user" else [_assistant_turn(message)]
    return messages


def _user_turns(message: Message) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages, its text as a user message, in their order."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.blocks():
        if isinstance(block, ToolResultBlock):
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            text = block.text()
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": f"Error: {text}" if block.is_error else text})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
    if texts:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant_turn(message: Message) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks():
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    if not body.tools:
        return {}
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": tool.name, "parameters": tool.input_schema,
        **({"description": tool.description} if tool.description is not None else {})}} for tool in body.tools]}
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (_TOOL_CHOICE[choice.type] if choice.type != "tool"
                                 else {"type": "function", "function": {"name": choice.name}})
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def chat_body(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders and samples as `body` asks; a mismatch the chat checks find is a 400."""
    fields: dict[str, Any] = {"messages": _conversation(body), **_tool_fields(body)}
    if body.messages[-1].role == "assistant":  # a prefill: the answer continues the last message
        fields["continue_final_message"] = True
    if body.thinking is not None and body.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
    try:
        return ChatCompletionRequest.model_validate_json(orjson.dumps(fields))
    except pydantic.ValidationError as error:
        raise validation_error(error) from None
    except orjson.JSONEncodeError as error:  # JSON that JSON allows and the chat request cannot hold (an integer
        raise APIError(f"the request cannot be served: {error}") from None  # past 64 bits inside a tool's schema)


def stop_reason(finish: Optional[dict[str, Any]], made_calls: bool,
                stop_sequences: Optional[list[str]]) -> tuple[str, Optional[str]]:
    """The engine's finish reason as Anthropic's (stop_reason, stop_sequence)."""
    kind = (finish or {}).get("type")
    matched = (finish or {}).get("matched")
    if kind == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if kind == "stop" and isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None
