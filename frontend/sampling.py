"""Sampling settings of a program run, and how a `gen` call's own settings override them.

`f.run(temperature=0, max_new_tokens=64)` sets the defaults of every `gen` in the program; a `gen(...)`
argument that is not None wins. The result is the native API's request fields: `sampling_params` (SGLang
names, as the Engine and `/generate` take them) plus the logprob options. A gen's `dtype` becomes a `regex`
(dtypes.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from radixserve.frontend.dtypes import dtype_regex, dtype_stops
from radixserve.frontend.global_config import global_config
from radixserve.frontend.ir import GenParams

# Fields of GenParams that are request options, not sampling parameters.
_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults of a program run (SGLang's frontend defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: bool = False

    @staticmethod
    def make(**values: Any) -> "SamplingDefaults":
        """Build from keyword arguments, ignoring None (= keep the default); str/list stops become tuples."""
        clean = {name: value for name, value in values.items() if value is not None}
        for name in ("stop", "stop_token_ids"):
            if name in clean:
                clean[name] = as_tuple(clean[name])
        return SamplingDefaults(**clean)

    def resolve(self, params: GenParams) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sampling_params, logprob options) for one `gen` call: its own settings over these defaults, its
        dtype as a regex constraint (plus its stop strings), and global_config's special-token settings."""
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f in dataclasses.fields(params):
            value = getattr(params, f.name)
            if value is not None:
                merged[f.name] = value
        options = {name: merged.pop(name) for name in _LOGPROB_FIELDS}
        dtype = merged.pop("dtype", None)
        if dtype is not None:
            merged["regex"] = dtype_regex(dtype)
            merged["stop"] = tuple(merged["stop"]) + tuple(stop for stop in dtype_stops(dtype)
                                                           if stop not in merged["stop"])
        for name in ("regex", "json_schema"):
            if merged.get(name) is None:
                merged.pop(name, None)
        merged["stop"] = list(merged["stop"])
        merged["stop_token_ids"] = list(merged["stop_token_ids"])
        merged["skip_special_tokens"] = global_config.skip_special_tokens_in_output
        merged["spaces_between_special_tokens"] = global_config.spaces_between_special_tokens_in_out
        return merged, options


def as_tuple(value: Any) -> tuple:
    """A stop argument as a tuple: one string is one stop string, not its characters."""
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value)
