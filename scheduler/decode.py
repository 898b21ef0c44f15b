"""The decode planner: one more token for every running request, or a speculative verify step in its place.

Each request takes one KV slot for its next token (`allocate`). Out of KV memory, the tree is evicted first
(inside `allocate_slots`); then, under overlap, the batch in flight is waited for, since requests finishing
in it free memory; only then is a request retracted (longest remaining output first) back to the queue.
A request whose next step reads its earlier outputs (`needs_exact_history`: penalties, speculative decoding)
waits for the batch in flight before it is scheduled.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.radix_cache.base import PrefixCache
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.scheduler.batch import ScheduleBatch, allocate_slots, needs_exact_history
from radixserve.scheduler.batch_builder import BatchBuilder
from radixserve.scheduler.lifecycle import RequestLifecycle
from radixserve.scheduler.policy import NewTokenRatio
from radixserve.scheduler.req import Req
from radixserve.scheduler.results import ResultProcessor


class DecodePlanner:
    def __init__(self, *, requests: RequestLifecycle, cache: PrefixCache, allocator: KVAllocator,
                 req_to_token_pool: ReqToTokenPool, speculator: Any, new_token_ratio: NewTokenRatio,
                 builder: BatchBuilder, results: ResultProcessor) -> None:
        self.requests = requests
        self.cache = cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.speculator = speculator  # a Speculator, or NoSpeculation (scheduler/speculative/)
        self.new_token_ratio = new_token_ratio
        self.builder = builder
        self.results = results

    def schedule(self) -> Optional[ScheduleBatch]:
        """The next decode (or verify) batch of the running requests, or None when none can run."""
        reqs = self._decoding()
        if reqs and self.results.inflight and any(needs_exact_history(r) for r in reqs):
            self.results.resolve_inflight()
            reqs = self._decoding()
        if reqs and (verify := self.speculator.plan(reqs)) is not None:
            self.new_token_ratio.decay()
            return verify
        slots = None
        while reqs and (slots := self.allocate(reqs)) is None:
            if self.results.inflight:
                # Finishing requests of the batch in flight may free enough; retract only if not.
                self.results.resolve_inflight()
                reqs = self._decoding()
                continue
            victim = max(reqs, key=lambda r: (r.remaining_new_tokens(), r.kv_len))
            reqs.remove(victim)
            self.requests.retract(victim)
        if not reqs:
            return None
        self.new_token_ratio.decay()
        return self.builder.make(ForwardMode.DECODE, [], reqs, slots)

    def mixed_decodes(self) -> tuple[list[Req], Optional[torch.Tensor]]:
        """Running requests that decode inside an extend batch (and their slots), if all of them fit."""
        reqs = [r for r in self.requests.running
                if r.needs_more_tokens() and not (self.results.inflight and needs_exact_history(r))]
        slots = self.allocate(reqs) if reqs else None
        return (reqs, slots) if slots is not None else ([], None)

    def allocate(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        """One slot for each request's next token (evicting if needed), raising their kv_len; None if short."""
        slots = allocate_slots(self.allocator, self.cache, self.req_to_token_pool,
                               [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], [1] * len(reqs))
        if slots is not None:
            for req in reqs:
                req.kv_len += 1
        return slots

    def _decoding(self) -> list[Req]:
        return [r for r in self.requests.running if r.needs_more_tokens()]
