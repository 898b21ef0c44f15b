"""A generation request inside the scheduler, and its KV state.

Token bookkeeping of a request with prompt length `L` (`origin_input_ids`) and `output_ids` generated so far:

- `all_ids = origin_input_ids + output_ids`; `kv_len` leading tokens of it have KV slots recorded in the
  request's `req_to_token` row (computed, or being computed by a launched batch). The scheduler raises
  `kv_len` when it builds a batch, before the batch runs.
- A batch that takes the request's KV up to `kv_len = K >= L` samples the token at position `K`, i.e.
  `output_ids[K - L]`; so once every launched batch is processed the request holds `K - L + 1` outputs and
  the last output has no KV yet. `num_outputs_when_done()` is that count, known without waiting for results.
- `prefix_indices` / `last_node` are the radix cache's view: the KV slots of the row's leading tokens that
  the tree owns, and the locked tree node that ends them. Slots after `len(prefix_indices)` up to `kv_len` are
  the request's own ("held") until it is released into the cache.

Ownership: a request's row and KV are released exactly once, through `RequestLifecycle.release_kv`
(scheduler/lifecycle.py), and only when no launched batch that includes the request is still unprocessed
(`num_inflight == 0`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from radixserve.runtime.wire.messages import (
    FinishReason,
    SamplingParams,
    SessionRetention,
    TokenizedGenerateReq,
    options_of,
)
from radixserve.runtime.wire.pooling import PoolingParams

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


def tenant_of(namespace: tuple[str, ...]) -> str:
    """The tenant part of a cache namespace ("tenant:<id>" first), or "" for the default tenant."""
    if namespace and namespace[0].startswith("tenant:"):
        return namespace[0][len("tenant:"):]
    return ""


class Req:
    """One request: its prompt, sampling parameters, outputs so far and where its KV lives."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        namespace: tuple[str, ...] = (),
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        priority: Optional[int] = None,
        tenant_weight: float = 1.0,
        lora_name: Optional[str] = None,
        pooling: Optional[PoolingParams] = None,
        retention: Optional[SessionRetention] = None,
        arrival_seq: int = 0,
    ) -> None:
        """The keywords before `arrival_seq` are RequestOptions' fields (runtime/wire/messages.py), which
        `from_message` passes on by name."""
        self.rid = rid
        # A tuple of ints is untracked by the cyclic collector after its first pass, so the prompts of a full batch
        # (millions of ids) are not walked again by every full collection while the requests run.
        self.origin_input_ids = tuple(origin_input_ids)
        self.sampling_params = sampling_params
        self.namespace = tuple(namespace)
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.stream = stream
        self.stream_interval = 1  # a stream is sent every this many new tokens (the server's --stream-interval)
        self.arrival_seq = arrival_seq  # order of arrival, for fcfs among re-queued requests
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.priority = priority
        self.tenant_weight = tenant_weight
        self.tenant = tenant_of(self.namespace)
        self.lora_name = lora_name
        # A pooling request (runtime/wire/pooling.py) prefills only; scheduler/pooling.py gathers its vector in
        # `pooled` over its chunks and sets `embedding` when it finishes.
        self.pooling = pooling
        self.pooled: Optional[torch.Tensor] = None
        self.embedding: Optional[list[float]] = None
        self.retention = retention  # kept cached after it finishes (radix_cache/retention.py)

        # Outputs
        self.output_ids: list[int] = []
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.finished_reason: Optional[FinishReason] = None
        self.num_sent_tokens = 0  # outputs already sent in a BatchTokenOut
        self.finish_sent = False
        # Prompt-token logprobs from logprob_start_len on (see scheduler/input_logprobs.py)
        self.input_token_logprobs: list[Optional[float]] = []
        self.input_top_logprobs: list[Optional[list[tuple[int, float]]]] = []
        self.input_logprobs_done = self.logprob_start_len < 0
        self.grammar: Any = None  # scheduler.grammar.GrammarState, once its grammar is compiled
        self.ended_without_sample = False  # finished because no token could be sampled (see the scheduler)
        self.spec: Any = None  # scheduler.speculative.state.SpecState, while speculative decoding runs

        # KV state (see the module docstring)
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        self.prefix_indices: torch.Tensor = _EMPTY_SLOTS
        self.last_node: Any = None
        self.num_inflight = 0  # launched batches holding this request whose results are not processed
        self.kv_unwritten = False  # a batch of it failed (out of device memory): its own slots hold no valid KV
        # Hybrid models (scheduler/hybrid_state.py): tokens its working recurrent state covers once the batches built so
        # far have run, and the snapshot slots its next extend fills, after it and before its last token (-1: none)
        self.state_len = 0
        self.pending_snapshot = self.pending_snapshot_before_last = -1
        # Sliding-window models with window slots (scheduler/window_release.py): positions below this have had their
        # window KV freed (or left to the tree's other holders)
        self.window_released = 0

        # Admission bookkeeping
        self.num_cached_tokens: Optional[int] = None  # prefix matched at first admission
        self.queued_at = time.monotonic()  # when the scheduler received the request
        self.queue_time: Optional[float] = None  # seconds from arrival to first admission
        self.num_retractions = 0

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReq, arrival_seq: int) -> "Req":
        return cls(msg.rid, msg.input_ids, msg.sampling_params, arrival_seq=arrival_seq, **options_of(msg))

    # ---- derived quantities ----------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def all_ids(self) -> list[int]:
        return [*self.origin_input_ids, *self.output_ids]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    def fill_len(self) -> int:
        """Tokens whose KV must exist before the request can decode: its prompt plus known outputs."""
        return self.prompt_len + len(self.output_ids)

    def num_outputs_when_done(self) -> int:
        """Outputs the request will hold once every launched batch including it is processed."""
        return max(len(self.output_ids), self.kv_len - self.prompt_len + 1)

    def needs_more_tokens(self) -> bool:
        """Whether scheduling one more token can still be useful (max_new_tokens not yet covered)."""
        return not self.finished and self.num_outputs_when_done() < self.max_new_tokens

    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - self.num_outputs_when_done())

    def held_kv_len(self) -> int:
        """Tokens with KV slots that the request owns (not in the tree)."""
        return self.kv_len - len(self.prefix_indices)

    # ---- transitions -----------------------------------------------------------------------------
    def on_first_admission(self, num_cached_tokens: int) -> None:
        """Record what the first admission found: the cached prefix length and the time spent waiting."""
        self.num_cached_tokens = num_cached_tokens
        self.queue_time = time.monotonic() - self.queued_at

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason

    def reset_kv_state(self) -> None:
        """Forget row and KV after they were handed back (finish or retraction)."""
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = _EMPTY_SLOTS
        self.last_node = None
        self.kv_unwritten = False
        self.state_len = 0
        self.pending_snapshot = self.pending_snapshot_before_last = -1
        self.window_released = 0

    def append_token(self, token_id: int, logprob: Optional[float], top_logprobs: Optional[list]) -> None:
        self.output_ids.append(token_id)
        if self.return_logprob:
            self.output_token_logprobs.append(logprob if logprob is not None else 0.0)
            self.output_top_logprobs.append(list(top_logprobs or [])[: self.top_logprobs_num])

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={self.prompt_len}, outputs={len(self.output_ids)}, kv_len={self.kv_len}, "
            f"row={self.req_pool_idx}, finished={self.finished_reason})"
        )
