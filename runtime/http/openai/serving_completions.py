"""POST /v1/completions: prompts (text or token ids, one or many) x n -> engine requests -> OpenAI response.

Choice `index` = prompt number * n + choice number, as OpenAI orders them. `echo` prepends the prompt to each
choice's text (in the first chunk when streaming); with `logprobs` it also reports the prompt tokens'
logprobs (the first one is null: nothing precedes it), which the engine computes in the prompt's extend pass.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.generation import GenerationRun, engine_error, respond
from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.openai.logprobs import completion_logprobs
from radixserve.runtime.http.openai.protocol import CompletionRequest
from radixserve.runtime.http.openai.serving_common import (
    ChoiceOutput,
    Delta,
    check_model,
    openai_finish_reason,
    sampling_params,
    usage,
)
from radixserve.runtime.http.openai.translate import completion_request, normalized


@dataclass
class _Prompt:
    input_ids: list[int]
    given_text: Optional[str]  # None for a token-id prompt: decoded for echo, once the engine accepted the ids

    def text(self, state: ServerState) -> str:
        if self.given_text is None:
            self.given_text = state.tokenizer.decode(self.input_ids)
        return self.given_text


async def _tokenize(state: ServerState, prompt: Union[str, list[int]], param: str) -> _Prompt:
    """Token ids of a prompt (text is tokenized off the event loop by the engine; ids are checked by it)."""
    if not isinstance(prompt, str):
        return _Prompt(list(prompt), None)
    try:
        return _Prompt(await state.engine.async_encode(prompt), prompt)
    except ValueError as error:
        raise engine_error(state, error, param=param) from None


async def create_completion(
    state: ServerState, http_request: Request, body: CompletionRequest, tenant: Optional[str]
) -> Response:
    lora_name = check_model(state, body.model, body.lora_path)
    params = sampling_params(state, body, body.max_tokens)
    raw_prompts = body.prompts()
    prompts = [await _tokenize(state, p, "prompt" if len(raw_prompts) == 1 else f"prompt[{i}]")
               for i, p in enumerate(raw_prompts)]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    request = normalized(completion_request(body, [prompt.input_ids for prompt in prompts], params, response_id,
                                            lora_name, tenant, state.tenants.weight_of(tenant)), state.model_info)
    requests = request.per_sample()  # one engine request per choice, prompt-major (index = prompt * n + choice)
    rids = [rid for sample_rids in request.sample_rids().values() for rid in sample_rids]
    header = {"id": response_id, "created": int(time.time()), "model": state.served_model_name}
    run = GenerationRun(state, {response_id: rids}, requests, tenant, http_request)
    return await respond(run, body.stream, lambda results: _response(state, body, header, prompts, results),
                         lambda events: _events(state, body, header, prompts, events))


def _response(state: ServerState, body: CompletionRequest, header: dict[str, Any], prompts: list[_Prompt],
              results: list[list[Any]]) -> dict[str, Any]:
    outputs = [ChoiceOutput() for _ in results]
    for output, chunks in zip(outputs, results):
        for chunk in chunks:
            output.add(chunk)
    choices = []
    for index, out in enumerate(outputs):
        prompt = prompts[index // body.n]
        delta = Delta(out.text, out.output_ids, out.token_logprobs, out.top_logprobs, out.finish_reason)
        text, logprobs, _ = _choice_text(state, body, prompt, out, delta, first=True, offset=0)
        reason, matched = openai_finish_reason(out.finish_reason)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                        "matched_stop": matched})
    groups = [outputs[i:i + body.n] for i in range(0, len(outputs), body.n)]
    return {**header, "object": "text_completion", "choices": choices, "usage": usage(groups),
            "system_fingerprint": None}


def _choice_text(
    state: ServerState, body: CompletionRequest, prompt: _Prompt, out: ChoiceOutput, delta: Delta,
    first: bool, offset: int,
) -> tuple[str, Optional[dict[str, Any]], int]:
    """(text, logprobs, next text offset) of a choice's new part; the first part carries the echo."""
    echo = body.echo and first
    text = (prompt.text(state) if echo else "") + delta.text
    if body.logprobs is None:
        return text, None, offset
    entries: list[Any] = []
    tops: list[Any] = []
    if echo:
        entries, tops = _prompt_logprobs(prompt, out)
    elif first:
        offset = len(prompt.text(state))
    entries += list(delta.token_logprobs)
    tops += list(delta.top_logprobs)
    logprobs = completion_logprobs(state.token_texts, entries, tops, body.logprobs, offset)
    end = offset + sum(len(t) for t in logprobs["tokens"])
    return text, logprobs, end


def _prompt_logprobs(prompt: _Prompt, out: ChoiceOutput) -> tuple[list[Any], list[Any]]:
    """Prompt token entries (logprob, token id) from the engine's input logprobs (the first token's logprob
    is null: nothing precedes it); null where the engine returned none."""
    engine_entries = list(out.input_token_logprobs or [])
    engine_tops = list(out.input_top_logprobs or [])
    entries, tops = [], []
    for position, token_id in enumerate(prompt.input_ids):
        logprob = engine_entries[position][0] if position < len(engine_entries) and position > 0 else None
        top = engine_tops[position] if position < len(engine_tops) and logprob is not None else None
        entries.append((logprob, token_id))
        tops.append(top)
    return entries, tops


async def _events(
    state: ServerState,
    body: CompletionRequest,
    header: dict[str, Any],
    prompts: list[_Prompt],
    events: AsyncIterator[tuple[int, Any]],
) -> AsyncIterator[dict[str, Any]]:
    num_choices = len(prompts) * body.n
    outputs = [ChoiceOutput() for _ in range(num_choices)]
    started = [False] * num_choices
    offsets = [0] * num_choices

    def chunk(index: int, text: str, logprobs: Any, finish: Optional[str], matched: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        event = {**header, "object": "text_completion", "choices": [choice]}
        if body.include_usage:
            event["usage"] = (usage([outputs[i:i + body.n] for i in range(0, num_choices, body.n)])
                              if body.continuous_usage else None)
        return event

    async for index, engine_chunk in events:
        out = outputs[index]
        delta = out.add(engine_chunk)
        first = not started[index]
        started[index] = True
        text, logprobs, offsets[index] = _choice_text(
            state, body, prompts[index // body.n], out, delta, first, offsets[index])
        reason, matched = openai_finish_reason(delta.finish_reason)
        if text or logprobs and logprobs["tokens"] or reason is not None:
            yield chunk(index, text, logprobs, reason, matched)
    if body.include_usage:
        groups = [outputs[i:i + body.n] for i in range(0, num_choices, body.n)]
        yield {**header, "object": "text_completion", "choices": [], "usage": usage(groups)}
