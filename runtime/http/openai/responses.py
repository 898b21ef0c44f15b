"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request runs as the chat route's request (the same template, tool-call grammar and parser, reasoning parser and
sampling checks): `instructions` is the system message (never carried over to the next turn, as OpenAI has it),
the conversation of `previous_response_id` (its input and output, kept by the response store) comes before the
new input items, function calls and their outputs are the chat's tool calls and tool messages, `text.format` the
chat's `response_format`. The answer is a response object whose `output` holds a `reasoning` item (with a
reasoning parser), a `message` item with the text and a `function_call` item per call; `usage` reports the input
tokens read from the radix cache as `cached_tokens`, so the turns of a chain report the prefix they share.
`status` is "incomplete" (reason max_output_tokens) when the output ran out of tokens.

With `store` (the default) the response and its conversation are kept per tenant (response_store.py) for
`previous_response_id`, `GET` and `DELETE`. Streaming sends the Responses events (`response.created`,
`response.in_progress`, `response.output_item.added` / `.done`, `response.content_part.added` / `.done`,
`response.output_text.delta` / `.done`, `response.reasoning_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, then `response.completed` or `response.incomplete`), each
with its `sequence_number`; an error once the stream started is an `error` event.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

import msgspec
import orjson
import pydantic
from fastapi import Depends
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.errors import APIError, validation_error
from radixserve.runtime.http.generation import (
    ClientDisconnected,
    GenerationRun,
    json_response,
    respond,
)
from radixserve.runtime.http.openai.chat_stream import ChoiceStream
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, parse_request
from radixserve.runtime.http.openai.response_store import ResponseStore, StoredResponse
from radixserve.runtime.http.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from radixserve.runtime.http.openai.serving_chat import encode_chat
from radixserve.runtime.http.openai.serving_common import ChoiceOutput, check_model, choice_output, sampling_params
from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan, plan_chat_output, split_output
from radixserve.runtime.http.openai.translate import chat_request, normalized
from radixserve.runtime.http.state import ServerState, caller_tenant

router = access_router(Access.TENANT)
RETENTION_SECONDS = {"in_memory": 600.0, "24h": 24 * 3600.0}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _not_found(response_id: str) -> APIError:
    return APIError(f"No response found with id '{response_id}'.", status_code=404, param="response_id",
                    code="not_found")


# ---- the request as a chat request ---------------------------------------------------------------------------


def conversation(body: ResponsesRequest, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of the conversation so far: `previous` (a stored response's), then the input items."""
    messages = list(previous)
    for item in body.items():
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one turn are one assistant message
                messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {"messages": system + messages, "max_tokens": body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
        fields["parallel_tool_calls"] = body.parallel_tool_calls
        if body.tool_choice is not None:
            fields["tool_choice"] = (body.tool_choice if isinstance(body.tool_choice, str)
                                     else {"type": "function", "function": {"name": body.tool_choice.name}})
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = {"type": text_format.type} if text_format.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": text_format.name or "output", "schema": text_format.schema_}}
    try:
        return ChatCompletionRequest.model_validate_json(orjson.dumps(fields))
    except pydantic.ValidationError as error:
        raise validation_error(error) from None
    except orjson.JSONEncodeError as error:  # JSON that JSON allows and the chat request cannot hold (an integer
        raise APIError(f"the request cannot be served: {error}") from None  # past 64 bits inside a tool's schema)


# ---- the response object ---------------------------------------------------------------------------------------


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as the response object repeats them."""
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                 else {"type": "text"}},
        "tool_choice": (body.tool_choice.model_dump() if body.tool_choice is not None
                        and not isinstance(body.tool_choice, str) else body.tool_choice or "auto"),
        "tools": [tool.model_dump() for tool in body.tools or []],
        "truncation": body.truncation,
        "metadata": body.metadata or {},
        "user": body.user,
        "error": None,
    }


def _usage(output: ChoiceOutput) -> dict[str, Any]:
    prompt_tokens = int(output.meta.get("prompt_tokens", 0))
    completion_tokens = len(output.output_ids)
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": int(output.meta.get("cached_tokens", 0))},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def _finished(header: dict[str, Any], output: ChoiceOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
    incomplete = (output.finish_reason or {}).get("type") == "length"
    return {**header, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items, "usage": _usage(output)}


def _message_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output_items(plan: ChatOutputPlan, output: ChoiceOutput) -> list[dict[str, Any]]:
    split = split_output(plan, output.text)
    items = [_reasoning_item(split.reasoning_content)] if split.reasoning_content else []
    if split.content:
        items.append(_message_item(split.content))
    items += [_call_item(call.id, call.name, call.arguments) for call in split.tool_calls]
    return items


def _assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message the next turn's conversation holds."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


# ---- the routes ----------------------------------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body = parse_request(ResponsesRequest, await request.body())
    lora_name = check_model(state, body.model)
    previous: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = _store(request).get(tenant, body.previous_response_id)
        if stored is None:
            raise _not_found(body.previous_response_id)
        previous = stored.conversation
    messages = conversation(body, previous)
    plan = plan_chat_output(state, _chat_body(body, messages))
    chat = plan.body
    params = sampling_params(state, chat, chat.max_new_tokens)
    input_ids = await encode_chat(state, chat.messages, plan, **chat.template_kwargs())
    response_id = f"resp_{uuid.uuid4().hex}"
    generate = chat_request(chat, input_ids, params, response_id, lora_name, tenant, state.tenants.weight_of(tenant))
    if body.prompt_cache_retention is not None:
        generate = msgspec.structs.replace(generate, prompt_cache_key=body.prompt_cache_key,
                                           prompt_cache_retention=RETENTION_SECONDS[body.prompt_cache_retention])
    engine_request = normalized(generate, state.model_info)
    run = GenerationRun(state, {response_id: engine_request.sample_rids()[response_id]},
                        engine_request.per_sample(), tenant, request)
    header = {"id": response_id, "object": "response", "created_at": int(time.time()),
              "model": body.model or state.served_model_name, **_echo(body)}

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            _store(request).put(tenant, StoredResponse(response, messages + [_assistant_turn(response["output"])]))

    def finished(results: list[list[Any]]) -> dict[str, Any]:
        output = choice_output(results[0])
        response = _finished(header, output, _output_items(plan, output))
        keep(response)
        return response

    return await respond(run, body.stream, finished, lambda events: _stream(plan, header, events, keep),
                         write_events=_sse)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    stored = _store(request).get(tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str,
                          tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    if not _store(request).delete(tenant, response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


# ---- streaming -------------------------------------------------------------------------------------------------


class _ItemStream:
    """The output items of a streamed response, built from ChoiceStream's OpenAI-shaped deltas: a delta of another
    kind finishes the open item and adds the next."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open_kind: Optional[str] = None

    def _ref(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def finish(self) -> list[dict[str, Any]]:
        """The events that finish the open item."""
        if self.open_kind is None:
            return []
        kind, self.open_kind = self.open_kind, None
        item = self.items[-1]
        item["status"] = "completed"
        events: list[dict[str, Any]] = []
        if kind == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **self._ref(), "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **self._ref(), "content_index": 0, "part": part}]
        elif kind == "reasoning":
            events.append({"type": "response.reasoning_text.done", **self._ref(), "content_index": 0,
                           "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", **self._ref(),
                           "arguments": item["arguments"], "name": item["name"]})
        return events + [{"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}]

    def _add(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.finish()
        self.items.append(item)
        self.open_kind = kind
        opened = {**item, "content": []} if kind in ("message", "reasoning") else dict(item)
        return events + [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": opened}]

    def events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "reasoning_content" in delta:
            if self.open_kind != "reasoning":
                events += self._add("reasoning", {**_reasoning_item(""), "status": "in_progress"})
            self.items[-1]["content"][0]["text"] += delta["reasoning_content"]
            events.append({"type": "response.reasoning_text.delta", **self._ref(), "content_index": 0,
                           "delta": delta["reasoning_content"]})
        elif "content" in delta:
            if self.open_kind != "message":
                item = _message_item("", status="in_progress")
                events += self._add("message", item)
                events.append({"type": "response.content_part.added", **self._ref(), "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
            self.items[-1]["content"][0]["text"] += delta["content"]
            events.append({"type": "response.output_text.delta", **self._ref(), "content_index": 0,
                           "delta": delta["content"], "logprobs": []})
        for call in delta.get("tool_calls", []):
            if "id" in call:
                events += self._add("function_call", _call_item(call["id"], call["function"]["name"], "",
                                                                status="in_progress"))
            elif call["function"]["arguments"]:
                self.items[-1]["arguments"] += call["function"]["arguments"]
                events.append({"type": "response.function_call_arguments.delta", **self._ref(),
                               "delta": call["function"]["arguments"]})
        return events


async def _stream(plan: ChatOutputPlan, header: dict[str, Any], events: AsyncIterator[tuple[int, Any]],
                  keep: Any) -> AsyncIterator[dict[str, Any]]:
    running = {**header, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield {"type": "response.created", "response": running}
    yield {"type": "response.in_progress", "response": running}
    output = ChoiceOutput()
    stream = ChoiceStream(plan)
    items = _ItemStream()
    async for _, chunk in events:
        delta = output.add(chunk)
        for message_delta in stream.feed(delta.text, finished=bool(delta.finish_reason)):
            for event in items.events(message_delta):
                yield event
    for event in items.finish():
        yield event
    response = _finished(header, output, items.items)
    keep(response)
    yield {"type": "response.completed" if response["status"] == "completed" else "response.incomplete",
           "response": response}


async def _sse(run: GenerationRun, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    number = 0

    def encode(event: dict[str, Any]) -> bytes:
        nonlocal number
        number += 1
        return (b"event: " + event["type"].encode() + b"\ndata: "
                + orjson.dumps({**event, "sequence_number": number - 1}) + b"\n\n")

    try:
        async for event in events:
            yield encode(event)
    except APIError as error:
        yield encode({"type": "error", "code": error.code, "message": error.message, "param": error.param})
    except ClientDisconnected:
        return
    finally:
        run.close()
