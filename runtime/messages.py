"""Every message that crosses a process boundary, as tagged msgspec Structs.

TokenizerManager -> Scheduler:      TokenizedGenerateReq, AbortReq, FlushCacheReq, GetServerInfoReq
Scheduler -> DetokenizerManager:    BatchTokenOut (and control replies, forwarded untouched)
DetokenizerManager -> Tokenizer:    BatchTextOut, FlushCacheReqOutput, GetServerInfoReqOutput
Children -> parent at start-up:     ProcessReady or ProcessFailed (on the same socket as their outputs)

Sockets carry `encode(msg)` bytes and are read with `decode(data)`; no pickle. This module imports
nothing from the components, so every process can use it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling parameters, with SGLang's names."""

    max_new_tokens: int = 128
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


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    namespace: tuple[str, ...] = ()  # cache namespace: (tenant id, cache_salt, ...); () is the default
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input-token logprobs
    top_logprobs_num: int = 0
    stream: bool = False


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class FlushCacheReq(msgspec.Struct, tag=True):
    rpc_id: str


class FlushCacheReqOutput(msgspec.Struct, tag=True):
    rpc_id: str
    success: bool
    message: str = ""


class GetServerInfoReq(msgspec.Struct, tag=True):
    rpc_id: str


class GetServerInfoReqOutput(msgspec.Struct, tag=True):
    rpc_id: str
    info: dict[str, Any]


class BatchTokenOut(msgspec.Struct, tag=True):
    """New tokens of several requests after one scheduler step (index i of every list is request i)."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[Optional[dict[str, Any]]]  # None while running; {"type": "stop"|"length"|"abort", ...}
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    stop: list[list[str]]  # stop strings (trimmed by the detokenizer): with a request's first output only, else []
    # Logprobs of the new tokens (empty lists when not requested).
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[int, float]]]] = []
    # Input-token logprobs, sent once with a request's first output.
    input_token_logprobs: list[Optional[list[Optional[float]]]] = []
    input_top_logprobs: list[Optional[list[Optional[list[tuple[int, float]]]]]] = []


class BatchTextOut(msgspec.Struct, tag=True):
    """The detokenized counterpart of BatchTokenOut: text deltas that are safe to show."""

    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[Optional[dict[str, Any]]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[int, float]]]] = []
    input_token_logprobs: list[Optional[list[Optional[float]]]] = []
    input_top_logprobs: list[Optional[list[Optional[list[tuple[int, float]]]]]] = []


class ProcessReady(msgspec.Struct, tag=True):
    process: str  # "scheduler" | "detokenizer"
    info: dict[str, Any] = {}


class ProcessFailed(msgspec.Struct, tag=True):
    process: str
    error: str  # the formatted traceback


Message = Union[
    TokenizedGenerateReq,
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    BatchTokenOut,
    BatchTextOut,
    ProcessReady,
    ProcessFailed,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
