"""Checking a request's sampling parameters before anything is queued.

`build_sampling_params` turns the caller's dict (SGLang's names) into a `SamplingParams` message struct, or
raises ValueError naming the offending field. `check_length` enforces the context window. Both are pure
functions of their arguments so the TokenizerManager can run them for a whole batch before sending any of it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import msgspec

from radixserve.runtime.messages import SamplingParams
from radixserve.tokenizer_manager.errors import ContextLengthExceededError
from radixserve.tokenizer_manager.grammar_check import check_grammar


KNOWN_PARAMS = frozenset(f for f in SamplingParams.__struct_fields__)
INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")


def _require_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _require_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _token_id(name: str, value: Any, vocab_size: int) -> int:
    try:
        token = int(value)  # logit_bias keys arrive as strings from JSON
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a token id") from None
    if isinstance(value, bool) or isinstance(value, float) or not 0 <= token < vocab_size:
        raise ValueError(f"{name}: token id {value!r} is outside the vocabulary [0, {vocab_size})")
    return token


def build_sampling_params(params: Optional[dict[str, Any]], vocab_size: int) -> SamplingParams:
    """Validate `params` and return the SamplingParams to send.

    `max_new_tokens` may be None, meaning "up to the context window" (resolved later by check_length);
    the returned struct then carries -1 until check_length fills it in. Raises ValueError for unknown names,
    wrong types and out-of-range values.
    """
    params = dict(params or {})
    unknown = sorted(set(params) - KNOWN_PARAMS)
    if unknown:
        raise ValueError(
            f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_PARAMS))}"
        )
    out: dict[str, Any] = {}
    for name in INT_FIELDS:
        if name in params and not (name == "max_new_tokens" and params[name] is None):
            out[name] = _require_int(name, params[name])
    if out.get("max_new_tokens", 0) < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {out['max_new_tokens']}")
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        out["max_new_tokens"] = -1  # resolved by check_length
    for name in FLOAT_FIELDS:
        if name in params:
            out[name] = _require_float(name, params[name])
    for name in BOOL_FIELDS:
        if name in params:
            if not isinstance(params[name], bool):
                raise ValueError(f"{name} must be true or false, got {params[name]!r}")
            out[name] = params[name]

    if "stop" in params and params["stop"] is not None:
        stop = params["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        out["stop"] = list(dict.fromkeys(stop))
    if "stop_token_ids" in params and params["stop_token_ids"] is not None:
        ids = params["stop_token_ids"]
        if not isinstance(ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        out["stop_token_ids"] = [_token_id("stop_token_ids", t, vocab_size) for t in ids]
    if params.get("seed") is not None:
        out["seed"] = _require_int("seed", params["seed"])
    if params.get("logit_bias") is not None:
        bias = params["logit_bias"]
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        out["logit_bias"] = {
            _token_id("logit_bias", token, vocab_size): _require_float(f"logit_bias[{token}]", value)
            for token, value in bias.items()
        }
    grammars = [name for name in ("json_schema", "regex", "ebnf") if params.get(name) is not None]
    if len(grammars) > 1:
        raise ValueError(f"give at most one of json_schema, regex, ebnf (got {', '.join(grammars)})")
    for name in grammars:
        value = params[name]
        if name == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string")
        check_grammar(name, value)
        out[name] = value

    sampling = msgspec.convert(out, SamplingParams)
    _check_ranges(sampling)
    return sampling


def _check_ranges(p: SamplingParams) -> None:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    check(p.max_new_tokens >= 0 or p.max_new_tokens == -1, f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    check(p.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {p.min_new_tokens}")
    check(p.max_new_tokens == -1 or p.min_new_tokens <= p.max_new_tokens,
          f"min_new_tokens ({p.min_new_tokens}) must not exceed max_new_tokens ({p.max_new_tokens})")
    check(p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}")
    check(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}")
    check(p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (no limit) or >= 1, got {p.top_k}")
    check(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}")
    check(p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    check(-2.0 <= p.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    check(-2.0 <= p.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    check(p.n >= 1, f"n must be >= 1, got {p.n}")


def check_length(
    sampling: SamplingParams, prompt_len: int, context_len: int, max_total_tokens: Optional[int] = None,
    page_size: int = 1,
) -> SamplingParams:
    """Check the prompt and its completion fit; resolve max_new_tokens=None (-1) to what is left.

    Raises ContextLengthExceededError when prompt_len + max_new_tokens exceeds context_len, or when the
    request alone (rounded up to whole pages) would not fit in a KV pool of max_total_tokens slots; ValueError
    for an empty prompt.
    """
    if prompt_len == 0:
        raise ValueError("the prompt is empty (it must hold at least one token)")
    limit, what = context_len, "context length"
    if max_total_tokens is not None and max_total_tokens // page_size * page_size < context_len:
        limit, what = max_total_tokens // page_size * page_size, "KV cache capacity"
    if sampling.max_new_tokens == -1:
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                f"the prompt has {prompt_len} tokens, which leaves no room in the model's {what} of {limit}"
            )
        return msgspec.structs.replace(sampling, max_new_tokens=limit - prompt_len)
    if prompt_len + sampling.max_new_tokens > limit:
        raise ContextLengthExceededError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({sampling.max_new_tokens}) is "
            f"{prompt_len + sampling.max_new_tokens} tokens, more than the model's {what} of {limit}"
        )
    return sampling
