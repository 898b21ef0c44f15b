"""SamplingParams: a request's sampling parameters (SGLang's names), and the one place they are checked.

    params = SamplingParams.from_request({"temperature": 0.7, "max_new_tokens": 64}, vocab_size)  # or ValueError
    params = params.fit_context(prompt_len, limits)     # the one length rule; ContextLengthExceededError

Every surface (the Engine, native `/generate`, the OpenAI routes) turns what the caller sent into a dict of these
names and hands it to `from_request`; the structs it returns are trusted from then on (the TokenizerManager only
applies the length rule once the prompt is tokenized, the scheduler re-checks only what it alone knows). Grammar
texts are checked by `grammar_check.check_grammar`, which parses them with xgrammar.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import msgspec

from radixserve.runtime.wire.compat import SAMPLING_UNSUPPORTED, absorb_sampling
from radixserve.runtime.wire.errors import ContextLengthExceededError
from radixserve.runtime.wire.grammar_check import check_grammar

INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# What a model's generation_config.json may set for requests that leave it unset (SGLang's --sampling-defaults model).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature means greedy (SGLang's threshold); dividing logits by it would overflow them anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling parameters. `max_new_tokens=None` means "up to the context window" until
    `fit_context` resolves it; what reaches the scheduler always has a number."""

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def has_penalties(self) -> bool:
        """Whether sampling reads the request's earlier tokens (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_request(cls, params: Optional[dict[str, Any]], vocab_size: int,
                     defaults: Optional[Mapping[str, Any]] = None) -> "SamplingParams":
        """Check the caller's dict and build the struct; InvalidSamplingParams (a ValueError) names the field.

        A parameter that is absent or null is unset: `defaults` (the model's generation_config.json values,
        MODEL_DEFAULT_FIELDS only) fill it, else the struct's own default. Out-of-vocabulary stop_token_ids are
        dropped (as SGLang does: they can never be sampled). SGLang's sampling parameters that this server does
        not implement are accepted when they ask for nothing and refused otherwise (compat.py)."""
        params = {name: value for name, value in (params or {}).items()
                  if value is not None or name == "max_new_tokens"}  # None there: up to the context window
        for name, value in (defaults or {}).items():
            if name in MODEL_DEFAULT_FIELDS:
                params.setdefault(name, value)
        try:
            return _build(params, vocab_size)
        except ValueError as error:
            raise InvalidSamplingParams(str(error), _field_of(str(error), params)) from None

    def fit_context(self, prompt_len: int, limits: "LengthLimits") -> "SamplingParams":
        """The length rule: the prompt and its completion fit the context window and the KV pool.

        Resolves max_new_tokens=None to all the room left. Raises ContextLengthExceededError when they do not
        fit, ValueError for an empty prompt."""
        if prompt_len == 0:
            raise ValueError("the prompt is empty (it must hold at least one token)")
        limit, what = limits.max_sequence_tokens()
        if self.max_new_tokens is None:
            if prompt_len >= limit:
                raise ContextLengthExceededError(
                    f"the prompt has {prompt_len} tokens, which leaves no room in the model's {what} of {limit}")
            return msgspec.structs.replace(self, max_new_tokens=limit - prompt_len)
        if prompt_len + self.max_new_tokens > limit:
            raise ContextLengthExceededError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({self.max_new_tokens}) is "
                f"{prompt_len + self.max_new_tokens} tokens, more than the model's {what} of {limit}")
        return self


class InvalidSamplingParams(ValueError):
    """A sampling parameter the engine cannot accept; `field` is its name (None when no single one is at fault)."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


def _field_of(message: str, params: dict[str, Any]) -> Optional[str]:
    """The parameter a message of `_build` is about: every message starts with it, or names it ("invalid regex:
    ...", "unknown sampling parameter(s): foo", "give at most one of ... (got regex, ebnf)")."""
    if message.startswith("unknown sampling parameter"):
        return message.split(": ", 1)[1].split(",")[0].split(";")[0].strip()
    if message.startswith("give at most one"):
        return message.rsplit(", ", 1)[-1].rstrip(")")
    names = [name for name in (*SamplingParams.__struct_fields__, *SAMPLING_UNSUPPORTED)
             if message.startswith(name) or message.startswith(f"invalid {name}")]
    return max(names, key=len, default=None)


@dataclass(frozen=True)
class LengthLimits:
    """What bounds one sequence: the model's context window and the KV pool (whole pages)."""

    context_len: int
    max_total_tokens: Optional[int] = None
    page_size: int = 1

    def max_sequence_tokens(self) -> tuple[int, str]:
        """(the longest prompt + completion, what sets it)."""
        if self.max_total_tokens is not None:
            pool = self.max_total_tokens // self.page_size * self.page_size
            if pool < self.context_len:
                return pool, "KV cache capacity"
        return self.context_len, "context length"


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask the server to multiply (the server arguments of the same names; docs/security.md):
    sequences per prompt (`n`, and OpenAI's `best_of`), stop strings and their length, `logit_bias` entries. The
    scheduler reports them in ModelInfo, so every surface's `normalize` checks the same values."""

    max_request_n: int = 128
    max_stop_strings: int = 32
    max_stop_string_length: int = 1024  # characters
    max_logit_bias_tokens: int = 1024

    def check(self, params: "SamplingParams") -> None:
        """Raise InvalidSamplingParams naming the field of a parameter past its limit."""
        if params.n > self.max_request_n:
            raise InvalidSamplingParams(f"n must be at most {self.max_request_n} (--max-request-n), got {params.n}",
                                        "n")
        if len(params.stop) > self.max_stop_strings:
            raise InvalidSamplingParams(f"stop may hold at most {self.max_stop_strings} strings (--max-stop-strings), "
                                        f"got {len(params.stop)}", "stop")
        longest = max((len(stop) for stop in params.stop), default=0)
        if longest > self.max_stop_string_length:
            raise InvalidSamplingParams(f"stop strings may be at most {self.max_stop_string_length} characters long "
                                        f"(--max-stop-string-length), got one of {longest}", "stop")
        if params.logit_bias is not None and len(params.logit_bias) > self.max_logit_bias_tokens:
            raise InvalidSamplingParams(f"logit_bias may hold at most {self.max_logit_bias_tokens} tokens "
                                        f"(--max-logit-bias-tokens), got {len(params.logit_bias)}", "logit_bias")


# ---- checks -----------------------------------------------------------------------------------------


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


def _build(params: dict[str, Any], vocab_size: int) -> SamplingParams:
    absorb_sampling(params)
    unknown = sorted(set(params) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(SamplingParams.__struct_fields__))}")
    out: dict[str, Any] = {}
    for name in INT_FIELDS:
        if name in params and not (name == "max_new_tokens" and params[name] is None):
            out[name] = _require_int(name, params[name])
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        out["max_new_tokens"] = None
    for name in FLOAT_FIELDS:
        if name in params:
            out[name] = _require_float(name, params[name])
    for name in BOOL_FIELDS:
        if name in params:
            if not isinstance(params[name], bool):
                raise ValueError(f"{name} must be true or false, got {params[name]!r}")
            out[name] = params[name]
    if params.get("stop") is not None:
        stop = params["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        out["stop"] = list(dict.fromkeys(stop))
    if params.get("stop_token_ids") is not None:
        ids = params["stop_token_ids"]
        if not isinstance(ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"stop_token_ids: {token!r} is not a token id")
        out["stop_token_ids"] = [token for token in dict.fromkeys(ids) if token < vocab_size]
    if params.get("seed") is not None:
        out["seed"] = _require_int("seed", params["seed"])
    if params.get("logit_bias") is not None:
        bias = params["logit_bias"]
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        out["logit_bias"] = {_token_id("logit_bias", token, vocab_size): _require_float(f"logit_bias[{token}]", value)
                             for token, value in bias.items()} or None
    grammars = [name for name in GRAMMAR_FIELDS if params.get(name) is not None]
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
    sampling = SamplingParams(**out)
    _check_ranges(sampling)
    if 0.0 < sampling.temperature < GREEDY_BELOW_TEMPERATURE:
        sampling = msgspec.structs.replace(sampling, temperature=0.0)  # as SGLang: effectively greedy
    return sampling


def _check_ranges(p: SamplingParams) -> None:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    check(p.max_new_tokens is None or p.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    check(p.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {p.min_new_tokens}")
    check(p.max_new_tokens is None or p.min_new_tokens <= p.max_new_tokens,
          f"min_new_tokens ({p.min_new_tokens}) must not exceed max_new_tokens ({p.max_new_tokens})")
    check(p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}")
    check(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}")
    check(p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (no limit) or >= 1, got {p.top_k}")
    check(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}")
    check(p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    check(-2.0 <= p.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    check(-2.0 <= p.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    check(p.n >= 1, f"n must be >= 1, got {p.n}")
    check(p.seed is None or INT64_MIN <= p.seed <= INT64_MAX, f"seed must fit in 64 bits, got {p.seed}")
    check(p.logit_bias is None or all(-100.0 <= v <= 100.0 for v in p.logit_bias.values()),
          "logit_bias values must be in [-100, 100]")
