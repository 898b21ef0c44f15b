"""Tool calling and reasoning on the chat route: what a request asks for (`ChatOutputPlan`), the conversation
the chat template receives, and the assistant message made of the model's text.

The template gets `tools` as Hugging Face's convention has it. A template that does not mention `tools` cannot
render them, so the tools and the call format of `--tool-call-parser` are described in a system message instead,
and earlier assistant calls are written back in that format: the model sees its own format either way. With
every `tool_choice` but "none" the output is constrained by the grammar of tool_grammar.py (calls only for
"required" or a named function; free text or calls for "auto"). The parameter schemas are checked only where the
grammar must enforce them as written ("required", named); "auto" calls of a tool whose schema xgrammar cannot
compile take any JSON object, and with "none" the tools reach the template unchecked, as SGLang and vLLM pass them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Optional

from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.errors import bad_request
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, ChatMessage
from radixserve.runtime.http.openai.reasoning import ReasoningParser, get_reasoning_parser
from radixserve.runtime.http.openai.tool_grammar import (ToolSchemaError, check_tool_schemas, tool_call_grammar,
                                                         with_loose_schemas)
from radixserve.runtime.http.openai.tool_parsers import ToolCall, ToolParser, get_tool_parser
from radixserve.tokenizer_manager.tokenize import load_chat_template


@dataclass
class ChatOutputPlan:
    """How one chat request's output is read: which parsers apply and what the template gets."""

    tool_parser: Optional[ToolParser]  # None: tool calls are not parsed (no tools, or tool_choice none)
    reasoning_parser: Optional[ReasoningParser]  # None: no --reasoning-parser, or separate_reasoning false
    template_kwargs: dict[str, Any]
    conversation: list[dict[str, Any]]
    body: ChatCompletionRequest  # the request with the call grammar and detokenization it needs


@functools.lru_cache(maxsize=8)
def _template_source(chat_template_flag: Optional[str], tokenizer_template: Optional[str]) -> str:
    return load_chat_template(chat_template_flag) or tokenizer_template or ""


def template_renders_tools(state: ServerState) -> bool:
    template = getattr(state.tokenizer, "chat_template", None)
    return "tools" in _template_source(state.server_args.chat_template, template if isinstance(template, str)
                                       else None)


def _arguments_object(text: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be a JSON object in text", param=f"messages[{index}].tool_calls")
    return value


def conversation_of(messages: list[ChatMessage], call_writer: Optional[ToolParser] = None) -> list[dict[str, Any]]:
    """The chat template's input (Hugging Face's convention) for the request's messages. With `call_writer`,
    assistant calls are written into the content in that parser's format (for templates without tools)."""
    conversation: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
        if message.name:
            turn["name"] = message.name
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        if message.reasoning_content:  # Qwen 3's and DeepSeek's templates read (or drop) it
            turn["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            calls = [(call.function.name, _arguments_object(call.function.arguments, index))
                     for call in message.tool_calls]
            if call_writer is not None:
                turn["content"] = "\n".join(part for part in (turn["content"], call_writer.format_calls(calls)) if part)
            else:
                turn["tool_calls"] = [{"id": call.id, "type": "function",
                                       "function": {"name": name, "arguments": arguments}}
                                      for call, (name, arguments) in zip(message.tool_calls, calls)]
        conversation.append(turn)
    return conversation


def _with_instructions(conversation: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{instructions}".lstrip())
        return [first, *conversation[1:]]
    return [{"role": "system", "content": instructions}, *conversation]


def _call_grammar(body: ChatCompletionRequest, parser: ToolParser, reasoning: Optional[ReasoningParser]) -> str:
    """The request's call grammar (tool_grammar.py); a schema it cannot enforce is a 400."""
    assert body.tools
    mode = body.tool_choice_mode
    indexed = list(enumerate(body.tools))
    if mode == "named":
        indexed = [(i, tool) for i, tool in indexed
                   if tool.function.name == body.tool_choice.function.name]  # type: ignore[union-attr]
    tools = [tool for _, tool in indexed]
    where = [f"tools[{i}].function.parameters" for i, _ in indexed]
    try:
        if mode == "auto":
            tools = with_loose_schemas(tools)
        else:  # the calls are the whole output: each schema must hold as written
            check_tool_schemas(tools, where)
        return tool_call_grammar(parser, tools, auto=mode == "auto", reasoning=reasoning,
                                 parallel=body.parallel_tool_calls and mode != "named", where=where)
    except ToolSchemaError as error:
        raise bad_request(str(error), param="tools") from None


def plan_chat_output(state: ServerState, body: ChatCompletionRequest) -> ChatOutputPlan:
    """Check the request's tools against this server and work out the template input, the parsers and the
    grammar; every problem is a 400."""
    args = state.server_args
    mode = body.tool_choice_mode
    reasoning = get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser and body.separate_reasoning \
        else None
    template_kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if "tools" in template_kwargs or "add_generation_prompt" in template_kwargs:
        raise bad_request("chat_template_kwargs may not set tools or add_generation_prompt",
                          param="chat_template_kwargs")
    if not body.tools:
        return ChatOutputPlan(None, reasoning, template_kwargs, conversation_of(body.messages), body)
    parser = get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None
    renders_tools = template_renders_tools(state)
    if parser is None and (mode != "none" or not renders_tools):
        raise bad_request("this server does not parse tool calls: start it with --tool-call-parser (one of "
                          "hermes, qwen25, llama3, mistral, pythonic) to use tools", param="tools")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if renders_tools:
        template_kwargs["tools"] = tools
        conversation = conversation_of(body.messages)
    else:
        assert parser is not None
        conversation = conversation_of(body.messages, call_writer=parser)
        if mode != "none":  # "none": the model is not told how to call, so it answers in prose
            conversation = _with_instructions(conversation, parser.instructions(tools))
    if mode == "none":
        return ChatOutputPlan(None, reasoning, template_kwargs, conversation, body)
    assert parser is not None
    updates: dict[str, Any] = {}
    if parser.needs_special_tokens:
        updates["skip_special_tokens"] = False
    constrains = body.response_format is not None and body.response_format.type != "text"
    own_grammar = constrains or body.regex is not None or body.ebnf is not None or body.structured_outputs is not None
    if mode in ("required", "named") and own_grammar:
        raise bad_request("a required or named tool_choice constrains the output itself; drop "
                          "response_format, regex and ebnf", param="tool_choice")
    if not own_grammar:  # with "auto", a request's own grammar takes the place of the call grammar
        updates["ebnf"] = _call_grammar(body, parser, reasoning)
    return ChatOutputPlan(parser, reasoning, template_kwargs, conversation, body.model_copy(update=updates))


@dataclass
class AssistantOutput:
    content: Optional[str]
    reasoning_content: Optional[str]
    tool_calls: list[ToolCall]


def split_output(plan: ChatOutputPlan, text: str) -> AssistantOutput:
    """A finished choice's text -> reasoning, content and tool calls."""
    reasoning: Optional[str] = None
    if plan.reasoning_parser is not None:
        split = plan.reasoning_parser.split(text)
        reasoning, text = split.reasoning or None, split.content
    calls: list[ToolCall] = []
    if plan.tool_parser is not None:
        parsed = plan.tool_parser.parse(text)
        text, calls = parsed.content, parsed.calls
        if calls and not text.strip():
            text = ""
    return AssistantOutput(text if text or not calls else None, reasoning, calls)


def assistant_message(output: AssistantOutput, plan: ChatOutputPlan) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": output.content, "refusal": None}
    if plan.reasoning_parser is not None:
        message["reasoning_content"] = output.reasoning_content
    if output.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in output.tool_calls]
    return message
