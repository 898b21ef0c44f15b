"""The scheduler's requests by state, and the transitions that end a request's hold on KV memory.

    waiting --admit (prefill.py)--> [chunked] --> running --finish--> released
       ^                                             |
       +------------------- retract ------------------+

`reqs` holds every request not yet released, whatever its state: queued for its grammar, waiting, chunked,
running, or finished while a launched batch still includes it. `news` holds the requests to consider for the
next BatchTokenOut (scheduler/output.py).

Release: a finished, aborted or retracted request hands its KV to the cache (`cache_finished_req`, so a
retracted request's re-prefill reuses it) and frees its row, in `release_kv` and nowhere else. A finished
request is released only once no launched batch that includes it is left unprocessed (`Req.num_inflight`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from radixserve.model_runner.sampling import PLACEHOLDER_TOKEN_ID
from radixserve.radix_cache.base import PrefixCache
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.retention import RetainedSessions
from radixserve.runtime.wire.messages import FinishReason
from radixserve.scheduler.cache_view import RecentRequests
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.policy import NewTokenRatio
from radixserve.scheduler.req import Req
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


class RequestLifecycle:
    def __init__(self, *, cache: PrefixCache, allocator: KVAllocator, req_to_token_pool: ReqToTokenPool,
                 speculator: Any, fair_share: FairShare, recent_requests: RecentRequests, stats: SchedulerStats,
                 new_token_ratio: NewTokenRatio, retention: RetainedSessions) -> None:
        self.cache = cache
        self.retention = retention
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.speculator = speculator
        self.fair_share = fair_share
        self.recent_requests = recent_requests
        self.stats = stats
        self.new_token_ratio = new_token_ratio

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.reqs: dict[str, Req] = {}  # every request not yet released, by rid
        self.news: dict[str, Req] = {}  # requests to consider for the next BatchTokenOut

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish(reason)
        self.fair_share.on_done(req)
        self.recent_requests.record(req)
        if req in self.running:
            self.running.remove(req)
        self.stats.num_finished += 1
        self.stats.num_aborted += reason.type == "abort"
        self.news[req.rid] = req
        self.maybe_release(req)

    def maybe_release(self, req: Req) -> None:
        """Release a finished request once no launched batch that includes it is left unprocessed."""
        if req.finished and req.num_inflight == 0 and self.reqs.get(req.rid) is req:
            self.release_kv(req)
            del self.reqs[req.rid]

    def retract(self, req: Req) -> None:
        """Send a running request back to the queue; its KV goes to the tree, its outputs are kept."""
        self.running.remove(req)
        self.release_kv(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio.reset()
        logger.info("retracted request %s (%d outputs so far) to free KV memory", req.rid, len(req.output_ids))

    def release_kv(self, req: Req) -> None:
        """The one place a request's KV and row are handed back: KV to the cache, row to the pool."""
        if req.req_pool_idx is not None and req.kv_unwritten:
            # After a failed batch (`ResultProcessor.fail_batch`, which empties the tree next): nothing new goes into
            # the tree; the request unlocks its prefix there and frees its own slots.
            kept = len(req.prefix_indices)
            self.cache.cache_finished_req(req, req.all_ids[:kept])
            own_slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, kept:req.kv_len]
            self.allocator.free(own_slots.to(torch.int64))
            self.req_to_token_pool.free(req.req_pool_idx)
        elif req.req_pool_idx is not None:
            token_ids = req.all_ids[: req.kv_len]
            if len(token_ids) < req.kv_len:
                # Only a request whose last step had no token to sample: under overlap the batch after it
                # already computed the next position, from the placeholder id the sampler wrote instead.
                assert req.ended_without_sample, f"{req!r} has KV for tokens it does not know"
                token_ids += [PLACEHOLDER_TOKEN_ID] * (req.kv_len - len(token_ids))
            self.cache.cache_finished_req(req, token_ids)
            if req.retention is not None and req.finished:
                self.retention.retain(req.namespace, req.retention.key, token_ids, req.retention.seconds)
            self.req_to_token_pool.free(req.req_pool_idx)
        self.speculator.release(req)
        req.reset_kv_state()

    def held_kv(self, page_size: int) -> tuple[int, int]:
        """(KV slots held by requests and not yet in the tree, request rows in use), for the invariant check."""
        held = rows_in_use = 0
        for req in self.reqs.values():
            if req.req_pool_idx is not None:
                rows_in_use += 1
                held += -(-req.held_kv_len() // page_size) * page_size
        return held, rows_in_use
