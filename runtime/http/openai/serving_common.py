"""Pieces shared by the chat and completions routes: model check, sampling parameters, per-choice accumulation
of engine output, finish reasons and usage.

The routes check only what the OpenAI protocol itself says (pydantic models in protocol.py) and map its fields
onto SGLang's sampling parameters; `SamplingParams.from_request` is the one validator of those, and the
TokenizerManager applies the one length rule once the prompt is tokenized."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgspec

from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.errors import APIError, bad_request
from radixserve.runtime.http.openai.protocol import (
    OpenAISamplingFields,
    StructuredOutputs,
    parse_logit_bias,
    stop_list,
)
from radixserve.runtime.http.openai.python_call_grammar import ebnf_string
from radixserve.runtime.wire.request import sample_seed
from radixserve.runtime.wire.sampling_params import InvalidSamplingParams, SamplingParams

# The OpenAI field that maps onto each sampling parameter, for the `param` of a 400.
_OPENAI_PARAM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format"}


def check_model(state: ServerState, model: Optional[str], lora_path: Optional[str] = None) -> Optional[str]:
    """The LoRA adapter a request runs under (runtime/http/lora_api.py), None for the base model.

    `model` picks an adapter by its name or as `<served model>:<adapter>`; any other name runs the one base model
    served, as SGLang serves it (clients send placeholders such as "default" or the name of the model they were
    written for). A name that would pick an adapter not loaded (`<served model>:<other>`) is a 404; naming an
    adapter in `model` and another in `lora_path` a 400."""
    adapters = state.engine.lora_adapters
    by_model: Optional[str] = None
    if model is not None and model != state.served_model_name:
        base, _, suffix = model.partition(":")
        if model in adapters:
            by_model = model
        elif base == state.served_model_name and suffix in adapters:
            by_model = suffix
        elif base == state.served_model_name:
            raise APIError(f"The model '{model}' does not exist: {state.served_model_name} has no adapter "
                           f"{suffix!r} loaded.", status_code=404, param="model", code="model_not_found")
    if lora_path:
        if by_model is not None and by_model != lora_path:
            raise APIError(f"model names adapter {by_model!r} but lora_path names {lora_path!r}", param="lora_path")
        return lora_path  # an unknown name is the TokenizerManager's 400
    return by_model


def sampling_params(state: ServerState, body: OpenAISamplingFields, max_new_tokens: Optional[int]) -> SamplingParams:
    """OpenAI fields -> the engine's SamplingParams (SGLang names), checked once, by SamplingParams itself.

    `max_new_tokens` None: up to the context window (the TokenizerManager resolves it). Sampling values the
    request leaves unset stay None, for the model's defaults to fill (--sampling-defaults)."""
    temperature, top_p = body.temperature, body.top_p
    if top_p == 0.0:  # a nucleus of probability 0 keeps only the most likely token
        temperature, top_p = 0.0, 1.0
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": body.min_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1 if body.top_k == 0 else body.top_k,  # vLLM's 0 is SGLang's -1: no limit
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "stop": stop_list(body.stop),
        "stop_token_ids": list(body.stop_token_ids),
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "logit_bias": parse_logit_bias(body.logit_bias),
        "seed": body.seed,
    }
    params.update(constraint_params(body))
    try:
        return SamplingParams.from_request(params, state.vocab_size, state.model_info.sampling_defaults)
    except InvalidSamplingParams as error:
        raise bad_request(str(error), param=_OPENAI_PARAM.get(error.field, error.field)) from None


def constraint_params(body: OpenAISamplingFields) -> dict[str, Any]:
    """The structured-output sampling parameter of `response_format` (json_object: any JSON object;
    json_schema: its `schema`), or of the `regex` / `ebnf` extras; {} when unconstrained. At most one of the
    three may be given (SamplingParams checks the grammar itself)."""
    given: list[tuple[str, str, str]] = []  # (param, sampling parameter, grammar text)
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", "json_schema", json.dumps({"type": "object"})))
    elif fmt is not None and fmt.type == "json_schema":
        given.append(("response_format", "json_schema", json.dumps((fmt.json_schema or {}).get("schema", {}))))
    if body.regex is not None:
        given.append(("regex", "regex", body.regex))
    if body.ebnf is not None:
        given.append(("ebnf", "ebnf", body.ebnf))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", *_structured_outputs_param(body.structured_outputs)))
    if len(given) > 1:
        raise bad_request(f"give at most one of response_format (json), regex, ebnf and structured_outputs; got "
                          f"{', '.join(param for param, _, _ in given)}", param=given[1][0])
    return {name: text for _, name, text in given}


def _structured_outputs_param(outputs: StructuredOutputs) -> tuple[str, str]:
    """vLLM's structured_outputs as (sampling parameter, grammar text); `choice` is a grammar of its strings."""
    if outputs.json_schema is not None:
        schema = outputs.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if outputs.json_object:
        return "json_schema", json.dumps({"type": "object"})
    if outputs.regex is not None:
        return "regex", outputs.regex
    if outputs.choice is not None:
        return "ebnf", "root ::= " + " | ".join(ebnf_string(choice) for choice in outputs.choice)
    assert outputs.grammar is not None
    return "ebnf", outputs.grammar


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i's parameters: its sample's seed as `normalize` draws it (seed + i, kept in 64 bits)."""
    if choice == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=sample_seed(params.seed, choice))


def _new_part(values: Optional[list], seen: int, num_new: int) -> list:
    """The entries of a chunk's logprob list that belong to its new tokens, whether the engine sends the
    list per chunk (length num_new) or cumulatively (length seen + num_new)."""
    if not values:
        return []
    if seen > 0 and len(values) == seen + num_new:
        return list(values[seen:])
    return list(values)


@dataclass
class Delta:
    """What one engine chunk added to a choice."""

    text: str
    output_ids: list[int]
    token_logprobs: list[Any]
    top_logprobs: list[Any]
    finish_reason: Optional[dict[str, Any]]


@dataclass
class ChoiceOutput:
    """One choice's output accumulated over the engine's chunks (or taken from its one final result)."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[Any] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    input_token_logprobs: Optional[list[Any]] = None
    input_top_logprobs: Optional[list[Any]] = None
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, chunk: dict[str, Any]) -> Delta:
        meta = chunk.get("meta_info") or {}
        new_ids = list(chunk.get("output_ids") or [])
        seen = len(self.token_logprobs)
        new_logprobs = _new_part(meta.get("output_token_logprobs"), seen, len(new_ids))
        new_tops = _new_part(meta.get("output_top_logprobs"), len(self.top_logprobs), len(new_ids))
        if meta.get("input_token_logprobs") and self.input_token_logprobs is None:
            self.input_token_logprobs = list(meta["input_token_logprobs"])
            self.input_top_logprobs = list(meta.get("input_top_logprobs") or [])
        text = chunk.get("text") or ""
        self.text += text
        self.output_ids += new_ids
        self.token_logprobs += new_logprobs
        self.top_logprobs += new_tops
        self.meta.update(meta)
        return Delta(text, new_ids, new_logprobs, new_tops, meta.get("finish_reason"))

    @property
    def finish_reason(self) -> Optional[dict[str, Any]]:
        return self.meta.get("finish_reason")


def choice_output(chunks: list[Any]) -> ChoiceOutput:
    """One choice's output from the chunks its request produced (a GenerationRun's `collect`)."""
    output = ChoiceOutput()
    for chunk in chunks:
        output.add(chunk)
    return output


def openai_finish_reason(finish: Optional[dict[str, Any]]) -> tuple[Optional[str], Any]:
    """Engine finish reason -> (OpenAI finish_reason, the matched stop token or string)."""
    if not finish:
        return None, None
    kind = finish.get("type")
    if kind == "stop":
        return "stop", finish.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def usage(groups: Sequence[Sequence[ChoiceOutput]]) -> dict[str, Any]:
    """Usage over prompts x choices: each prompt counted once (from its first choice), every completion."""
    prompt_tokens = sum(int(group[0].meta.get("prompt_tokens", 0)) for group in groups)
    cached_tokens = sum(int(group[0].meta.get("cached_tokens", 0)) for group in groups)
    completion_tokens = sum(int(c.meta.get("completion_tokens", len(c.output_ids))) for g in groups for c in g)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
