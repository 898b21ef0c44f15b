"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat route's engine.

A request is translated into the chat route's request (translate.py) and runs as one: the same template, tool-call
grammar and parser, reasoning parser and sampling checks. The answer is Anthropic's message: content blocks
(`thinking`, `text`, `tool_use`), `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and usage, whose
`input_tokens` counts the prompt tokens computed and `cache_read_input_tokens` those read from the radix cache.
Streaming sends Anthropic's events: `message_start`, `ping`, per block `content_block_start`, its deltas
(`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` and
`message_stop`; an error once the stream started is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Optional

import orjson
from fastapi import Depends
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.anthropic.errors import AnthropicRoute, api_key_tenant, error_body
from radixserve.runtime.http.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixserve.runtime.http.anthropic.translate import chat_body, stop_reason
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.generation import (
    ClientDisconnected,
    GenerationRun,
    json_response,
    respond,
)
from radixserve.runtime.http.openai.chat_stream import ChoiceStream
from radixserve.runtime.http.openai.protocol import parse_request
from radixserve.runtime.http.openai.serving_chat import encode_chat
from radixserve.runtime.http.openai.serving_common import ChoiceOutput, check_model, choice_output, sampling_params
from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan, plan_chat_output, split_output
from radixserve.runtime.http.openai.tool_parsers import ToolCall
from radixserve.runtime.http.openai.translate import chat_request, normalized
from radixserve.runtime.http.state import ServerState

router = access_router(Access.TENANT, route_base=AnthropicRoute, key_check=api_key_tenant)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage(output: ChoiceOutput) -> dict[str, Any]:
    prompt_tokens = int(output.meta.get("prompt_tokens", 0))
    cached_tokens = int(output.meta.get("cached_tokens", 0))
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": len(output.output_ids),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


@router.post("/v1/messages")
async def create_message(request: Request, tenant: Optional[str] = Depends(api_key_tenant)) -> Response:
    state = _state(request)
    body = parse_request(MessagesRequest, await request.body())
    lora_name = check_model(state, body.model)
    plan = plan_chat_output(state, chat_body(body))
    chat = plan.body
    params = sampling_params(state, chat, chat.max_new_tokens)
    input_ids = await encode_chat(state, chat.messages, plan, **chat.template_kwargs())
    message_id = f"msg_{uuid.uuid4().hex}"
    engine_request = normalized(chat_request(chat, input_ids, params, message_id, lora_name, tenant,
                                             state.tenants.weight_of(tenant)), state.model_info)
    run = GenerationRun(state, {message_id: engine_request.sample_rids()[message_id]}, engine_request.per_sample(),
                        tenant, request)
    header = {"id": message_id, "type": "message", "role": "assistant", "model": body.model}
    return await respond(run, body.stream, lambda results: _message(plan, body, header, choice_output(results[0])),
                         lambda events: _stream(plan, body, header, events), write_events=_sse)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, tenant: Optional[str] = Depends(api_key_tenant)) -> Response:
    state = _state(request)
    body = parse_request(CountTokensRequest, await request.body())
    check_model(state, body.model)
    plan = plan_chat_output(state, chat_body(body))
    input_ids = await encode_chat(state, plan.body.messages, plan, **plan.body.template_kwargs())
    return json_response({"input_tokens": len(input_ids)})


def _message(plan: ChatOutputPlan, body: MessagesRequest, header: dict[str, Any],
             output: ChoiceOutput) -> dict[str, Any]:
    split = split_output(plan, output.text)
    content: list[dict[str, Any]] = []
    if split.reasoning_content:
        content.append({"type": "thinking", "thinking": split.reasoning_content, "signature": ""})
    if split.content:
        content.append({"type": "text", "text": split.content})
    for call in split.tool_calls:
        content.append({"type": "tool_use", "id": _tool_use_id(call), "name": call.name,
                        "input": json.loads(call.arguments)})
    reason, sequence = stop_reason(output.finish_reason, bool(split.tool_calls), body.stop_sequences)
    return {**header, "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(output)}


class _Blocks:
    """The content blocks of a streamed message: a delta of another kind closes the open block and opens one."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: Optional[str] = None

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Anthropic's events for one of ChoiceStream's OpenAI-shaped deltas."""
        events: list[dict[str, Any]] = []
        if "reasoning_content" in delta:
            if self.open_kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
        elif "content" in delta:
            if self.open_kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls", []):
            if "id" in call:
                block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                         "name": call["function"]["name"], "input": {}}
                events += self._open("tool_use", block)
            elif call["function"]["arguments"]:
                events.append({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
        return events


async def _stream(plan: ChatOutputPlan, body: MessagesRequest, header: dict[str, Any],
                  events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[dict[str, Any]]:
    output = ChoiceOutput()
    stream = ChoiceStream(plan)
    blocks = _Blocks()
    started = False
    async for _, chunk in events:
        delta = output.add(chunk)
        if not started:
            started = True
            usage = {**_usage(output), "output_tokens": 0}
            yield {"type": "message_start", "message": {**header, "content": [], "stop_reason": None,
                                                        "stop_sequence": None, "usage": usage}}
            yield {"type": "ping"}
        for message_delta in stream.feed(delta.text, finished=bool(delta.finish_reason)):
            for event in blocks.events(message_delta):
                yield event
    for event in blocks.close():
        yield event
    reason, sequence = stop_reason(output.finish_reason, bool(stream.calls), body.stop_sequences)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": _usage(output)}
    yield {"type": "message_stop"}


def _sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _sse(run: GenerationRun, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield _sse_event(event)
    except APIError as error:
        yield _sse_event(error_body(error))
    except ClientDisconnected:
        return
    finally:
        run.close()
