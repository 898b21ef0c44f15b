"""POST /v1/chat/completions: messages -> chat template -> n engine requests -> OpenAI response or SSE stream."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.generation import GenerationRun, engine_error, respond
from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.openai.chat_stream import ChoiceStream
from radixserve.runtime.http.openai.logprobs import chat_logprobs
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, ChatMessage
from radixserve.runtime.http.openai.serving_common import (
    ChoiceOutput,
    check_model,
    openai_finish_reason,
    sampling_params,
    usage,
)
from radixserve.runtime.http.openai.tool_calling import (
    ChatOutputPlan,
    assistant_message,
    conversation_of,
    plan_chat_output,
    split_output,
)
from radixserve.runtime.http.openai.translate import chat_request, normalized


async def encode_chat(state: ServerState, messages: list[ChatMessage],
                      plan: Optional[ChatOutputPlan] = None, **template_kwargs: Any) -> list[int]:
    """Token ids of the conversation through the chat template, rendered off the event loop by the engine (with
    `plan`, its conversation and template arguments: tools, and the request's chat_template_kwargs; then
    `template_kwargs`, e.g. continue_final_message)."""
    conversation = plan.conversation if plan is not None else conversation_of(messages)
    try:
        return await state.engine.async_encode_chat(
            conversation, **{**(plan.template_kwargs if plan else {}), **template_kwargs})
    except ValueError as error:
        raise engine_error(state, error, param="messages") from None


async def create_chat_completion(
    state: ServerState, http_request: Request, body: ChatCompletionRequest, tenant: Optional[str]
) -> Response:
    lora_name = check_model(state, body.model, body.lora_path)
    plan = plan_chat_output(state, body)
    body = plan.body
    params = sampling_params(state, body, body.max_new_tokens)
    input_ids = await encode_chat(state, body.messages, plan, **body.template_kwargs())
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = normalized(chat_request(body, input_ids, params, response_id, lora_name, tenant,
                                      state.tenants.weight_of(tenant)), state.model_info)
    requests = request.per_sample()  # one engine request per choice
    rids = request.sample_rids()[response_id]
    run = GenerationRun(state, {response_id: rids}, requests, tenant, http_request)
    header = {"id": response_id, "created": int(time.time()), "model": state.served_model_name}
    return await respond(run, body.stream, lambda results: _response(state, plan, header, results),
                         lambda events: _events(state, plan, header, events))


def _response(state: ServerState, plan: ChatOutputPlan, header: dict[str, Any],
              results: list[list[Any]]) -> dict[str, Any]:
    outputs = [ChoiceOutput() for _ in results]
    for output, chunks in zip(outputs, results):
        for chunk in chunks:
            output.add(chunk)
    return {
        **header,
        "object": "chat.completion",
        "choices": [_choice(state, plan, i, out) for i, out in enumerate(outputs)],
        "usage": usage([outputs]),
        "system_fingerprint": None,
    }


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it is the assistant's, the turn the reply continues."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def _finish_reason(finish: Optional[dict[str, Any]], made_calls: bool) -> tuple[Optional[str], Any]:
    reason, matched = openai_finish_reason(finish)
    return ("tool_calls", None) if made_calls and reason == "stop" else (reason, matched)


def _choice(state: ServerState, plan: ChatOutputPlan, index: int, out: ChoiceOutput) -> dict[str, Any]:
    body = plan.body
    output = split_output(plan, out.text)
    reason, matched = _finish_reason(out.finish_reason, bool(output.tool_calls))
    logprobs = None
    if body.logprobs:
        logprobs = chat_logprobs(state.token_texts, out.token_logprobs, out.top_logprobs, body.top_logprobs or 0)
    message = assistant_message(output, plan)
    if _echoed(body):
        message["content"] = _echoed(body) + (message["content"] or "")
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": matched,
    }


async def _events(
    state: ServerState,
    plan: ChatOutputPlan,
    header: dict[str, Any],
    events: AsyncIterator[tuple[int, Any]],
) -> AsyncIterator[dict[str, Any]]:
    body = plan.body
    outputs = [ChoiceOutput() for _ in range(body.n)]
    streams = [ChoiceStream(plan) for _ in range(body.n)]
    started = [False] * body.n
    include_usage = body.include_usage

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: Optional[str] = None,
              matched: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        event = {**header, "object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            event["usage"] = usage([outputs]) if body.continuous_usage else None
        return event

    async for index, engine_chunk in events:
        delta = outputs[index].add(engine_chunk)
        if not started[index]:
            started[index] = True
            yield chunk(index, {"role": "assistant", "content": ""})
            if _echoed(body):
                yield chunk(index, {"content": _echoed(body)})
        deltas = streams[index].feed(delta.text, finished=bool(delta.finish_reason))
        logprobs = None
        if body.logprobs and delta.token_logprobs:
            logprobs = chat_logprobs(state.token_texts, delta.token_logprobs, delta.top_logprobs,
                                     body.top_logprobs or 0)
            deltas = deltas or [{"content": ""}]
        for number, message_delta in enumerate(deltas):
            yield chunk(index, message_delta, logprobs if number == 0 else None)
        if delta.finish_reason:
            reason, matched = _finish_reason(delta.finish_reason, bool(streams[index].calls))
            yield chunk(index, {}, finish=reason, matched=matched)
    if include_usage:
        yield {**header, "object": "chat.completion.chunk", "choices": [], "usage": usage([outputs])}
