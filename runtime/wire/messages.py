"""Every message that crosses a process boundary, as tagged msgspec Structs.

TokenizerManager -> Scheduler:      TokenizedGenerateReq, AbortReq, FlushCacheReq, GetServerInfoReq, CacheTreeReq,
                                    the weight, memory and pause requests of weights.py
Scheduler -> DetokenizerManager:    BatchTokenOut (and control replies, forwarded untouched)
DetokenizerManager -> Tokenizer:    BatchTextOut, FlushCacheReqOutput, GetServerInfoReqOutput, CacheTreeReqOutput
Scheduler -> DP controller:         ReplicaLoad (with --dp-size > 1: load and evicted prefixes, see
                                    runtime/data_parallel/)
Children -> parent at start-up:     ProcessReady (the scheduler's carries ModelInfo) or ProcessFailed (on the
                                    same socket as their outputs)

Sockets carry `encode(msg)` bytes and are read with `decode(data)`; no pickle. `SamplingParams` (the struct
every TokenizedGenerateReq carries) lives in `sampling_params.py` with its validation, `ModelInfo` and
`ServerInfo` (what a scheduler reports) in `server_info.py`. This module imports nothing from the components, so
every process can use it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from radixserve.runtime.wire.cache_tree import CacheTreeReq, CacheTreeReqOutput
from radixserve.runtime.wire.lora import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from radixserve.runtime.wire.pooling import PoolingParams
from radixserve.runtime.wire.sampling_params import SamplingParams
from radixserve.runtime.wire.server_info import ModelInfo, ServerInfo
from radixserve.runtime.wire.weights import (
    DEFAULT_WEIGHT_VERSION, ContinueGenerationReq, ControlReqOutput, DestroyWeightsUpdateGroupReq, GetWeightsByNameReq,
    GetWeightsByNameReqOutput, InitWeightsUpdateGroupReq, PauseGenerationReq, ReleaseMemoryOccupationReq,
    ResumeMemoryOccupationReq, UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq,
)


class FinishReason(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Why a request finished. `type` is "stop" (EOS, a stop token or string, or the grammar's end; `matched`
    names it), "length" (max_new_tokens; `length`) or "abort" (`message` says why). An abort that is an error
    rather than the caller's own abort carries the HTTP status it maps to (`status_code`: 400 when the request
    itself cannot be served, 500 for an internal fault)."""

    type: str
    matched: Union[int, str, None] = None
    length: Optional[int] = None
    message: Optional[str] = None
    status_code: Optional[int] = None

    @classmethod
    def stop(cls, matched: Union[int, str, None]) -> "FinishReason":
        return cls(type="stop", matched=matched)

    @classmethod
    def max_length(cls, length: int) -> "FinishReason":
        return cls(type="length", length=length)

    @classmethod
    def abort(cls, message: str, status_code: Optional[int] = None) -> "FinishReason":
        return cls(type="abort", message=message, status_code=status_code)

    @property
    def is_error(self) -> bool:
        return self.status_code is not None

    def to_dict(self) -> dict[str, Any]:
        """SGLang's meta_info shape: {"type": ..., "matched": ...} and the other fields that are set."""
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        for name in ("length", "message", "status_code"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class SessionRetention(msgspec.Struct, frozen=True):
    """Keep the request's prefix (prompt and output) cached for `seconds` after it finishes, as session `key` of its
    namespace (radix_cache/retention.py)."""

    key: str
    seconds: float


class RequestOptions(msgspec.Struct, kw_only=True):
    """What the scheduler reads of a request beside its prompt and sampling parameters, decided once by
    `request.normalize` and carried unchanged: into the TokenizedGenerateReq (which is one), then into the
    scheduler's `Req` (whose keyword arguments carry these names)."""

    namespace: tuple[str, ...] = ()  # cache namespace (request.make_namespace); () is the default
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input-token logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    priority: Optional[int] = None  # SGLang's per-request priority (scheduler/fair_share.py)
    tenant_weight: float = 1.0  # the tenant's fair-share weight, from the tenants file
    lora_name: Optional[str] = None  # the LoRA adapter to run under (None: the base model)
    pooling: Optional[PoolingParams] = None  # a prefill-only request returning a vector (runtime/wire/pooling.py)
    retention: Optional[SessionRetention] = None  # prompt_cache_key with prompt_cache_retention


def options_of(message: RequestOptions) -> dict[str, Any]:
    """The RequestOptions fields of `message` (a TokenizedGenerateReq), by name."""
    return {name: getattr(message, name) for name in RequestOptions.__struct_fields__}


class TokenizedGenerateReq(RequestOptions, tag=True):
    """One sample of one prompt, tokenized, with its RequestOptions."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    routed_dp_rank: Optional[int] = None  # the data-parallel replica the caller asked for (None: any)


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
    info: ServerInfo


class SpecCounts(msgspec.Struct, array_like=True):
    """One request's speculative decoding counts so far (meta_info's spec_* keys)."""

    verify_ct: int  # verify steps the request took part in
    accepted_drafts: int  # draft tokens accepted
    proposed_drafts: int  # draft tokens verified


class BatchTokenOut(msgspec.Struct, tag=True):
    """New tokens of several requests after one scheduler step (index i of every list is request i)."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[Optional[FinishReason]]  # None while running
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
    # Speculative decoding counts per request (empty when speculative decoding is off).
    spec: list[Optional[SpecCounts]] = []
    # Seconds each request waited in the scheduler's queue before its first admission (None: never admitted).
    queue_times: list[Optional[float]] = []
    # Pooling requests' vectors, sent with their finish (None for generation requests; empty when none pools).
    embeddings: list[Optional[list[float]]] = []
    weight_version: str = DEFAULT_WEIGHT_VERSION  # the weights these tokens were computed with (runtime/wire/weights.py)


class BatchTextOut(msgspec.Struct, tag=True):
    """The detokenized counterpart of BatchTokenOut: text deltas that are safe to show."""

    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[Optional[FinishReason]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[int, float]]]] = []
    input_token_logprobs: list[Optional[list[Optional[float]]]] = []
    input_top_logprobs: list[Optional[list[Optional[list[tuple[int, float]]]]]] = []
    spec: list[Optional[SpecCounts]] = []
    queue_times: list[Optional[float]] = []
    embeddings: list[Optional[list[float]]] = []
    weight_version: str = DEFAULT_WEIGHT_VERSION


class EvictedPrefix(msgspec.Struct):
    """A replica's radix tree dropped the tokens of `tokens` past `kept` in `namespace` (the path from the
    namespace root through the evicted leaf; the first `kept` of them are still cached)."""

    namespace: tuple[str, ...]
    tokens: list[int]
    kept: int


class ReplicaLoad(msgspec.Struct, tag=True):
    """A data-parallel replica's report to the controller: sent when its load changed (at most every few ms)."""

    dp_rank: int
    received: int  # generate requests received since start (the controller subtracts them from what it sent)
    received_tokens: int  # their prompt + max new tokens
    running: int
    waiting: int
    outstanding_tokens: int  # tokens the running and waiting requests still hold or need (prompt + max new)
    evicted: list[EvictedPrefix] = []
    flushed: bool = False  # the replica's cache was flushed since the last report


UNBOUNDED_NEW_TOKENS = 512  # what a request without max_new_tokens counts toward its replica's load


def request_tokens(message: TokenizedGenerateReq) -> int:
    """What a request adds to its data-parallel replica's load: its prompt and the most it may generate."""
    max_new = message.sampling_params.max_new_tokens
    return len(message.input_ids) + (UNBOUNDED_NEW_TOKENS if max_new is None else max_new) * message.sampling_params.n


class ProcessReady(msgspec.Struct, tag=True):
    process: str  # "scheduler" | "detokenizer"
    model: Optional[ModelInfo] = None  # the scheduler's


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
    CacheTreeReq,
    CacheTreeReqOutput,
    LoadLoRAAdapterReq,
    UnloadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    InitWeightsUpdateGroupReq,
    UpdateWeightsFromDistributedReq,
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
    GetWeightsByNameReqOutput,
    ReleaseMemoryOccupationReq,
    ResumeMemoryOccupationReq,
    PauseGenerationReq,
    ContinueGenerationReq,
    ControlReqOutput,
    BatchTokenOut,
    BatchTextOut,
    ReplicaLoad,
    ProcessReady,
    ProcessFailed,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
