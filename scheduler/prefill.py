"""The prefill planner: which waiting requests join the next extend batch, and how much of each.

One admission round (`schedule`):
- fair share first (scheduler/fair_share.py): when every row is taken, a tenant below its share of the rows may
  take one back (`preemption_victim`, the victim is retracted); another tenant's short request may go before the
  next chunk of a long prompt (`ahead_of_chunk`); the queue is served tenant by tenant, by priority within one;
- budgets (`PrefillAdder`, scheduler/policy.py): free + evictable KV tokens less the running requests' reserve,
  `max_prefill_tokens`, the chunk budget, `max_running_requests` and free rows;
- each admitted request matches its cached prefix, locks it, takes a row and slots for its first (or only) chunk;
  a long prompt is cut into chunks over several batches (the `chunked_req`, at most one at a time);
- a request whose prefix a request already in the batch computes waits one batch rather than compute it too;
- the tokens the batch computes go into the tree (`cache_unfinished_req`) before it runs, so the next batch can
  share them: every batch that reads them runs after this one;
- with `enable_mixed_chunk` the running requests ride along as one-token entries (ForwardMode.MIXED).
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.radix_cache.base import PrefixCache
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.scheduler.batch import ScheduleBatch, allocate_slots
from radixserve.scheduler.batch_builder import BatchBuilder
from radixserve.scheduler.decode import DecodePlanner
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.input_logprobs import prefix_limit
from radixserve.scheduler.lifecycle import RequestLifecycle
from radixserve.scheduler.lora import LoRAScheduling
from radixserve.scheduler.pooling import reusable_prefix
from radixserve.scheduler.policy import CLIP_MAX_NEW_TOKENS, NewTokenRatio, PrefillAdder, SchedulePolicy
from radixserve.scheduler.req import Req
from radixserve.scheduler.results import ResultProcessor
from radixserve.scheduler.stats import SchedulerStats, prefill_log_line, used_kv_tokens

logger = logging.getLogger(__name__)

# A request whose prefix is computed by a request already in the batch by at least this many more tokens than
# the tree holds waits for the next batch, which finds that prefix in the tree instead of computing it twice.
IN_BATCH_PREFIX_MIN_GAIN = 32

Entry = tuple[Req, int, int, torch.Tensor]  # (request, prefix_len, extend_len, slots) of one extend


class PrefillPlanner:
    def __init__(self, *, requests: RequestLifecycle, cache: PrefixCache, allocator: KVAllocator,
                 req_to_token_pool: ReqToTokenPool, policy: SchedulePolicy, fair_share: FairShare,
                 lora: LoRAScheduling, new_token_ratio: NewTokenRatio, stats: SchedulerStats, builder: BatchBuilder,
                 decode: DecodePlanner, results: ResultProcessor, max_running: int, max_prefill_tokens: int,
                 chunk_size: Optional[int], mixed_chunk: bool, pooling_reuses_prefix: bool = True) -> None:
        """`decode` gives a mixed batch its decoding requests; `results` is waited for before a preemption;
        `pooling_reuses_prefix`: whether a pooling request may start from a cached prefix (scheduler/pooling.py)."""
        self.requests = requests
        self.cache = cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.policy = policy
        self.fair_share = fair_share
        self.lora = lora
        self.new_token_ratio = new_token_ratio
        self.stats = stats
        self.builder = builder
        self.decode = decode
        self.results = results
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.mixed_chunk = mixed_chunk
        self.pooling_reuses_prefix = pooling_reuses_prefix

    def schedule(self) -> Optional[ScheduleBatch]:
        """The next extend (or mixed) batch, or None when no waiting request fits."""
        requests = self.requests
        if not requests.waiting and requests.chunked_req is None:
            return None
        rows = self.max_running - (requests.chunked_req is not None)
        if (victim := self.fair_share.preemption_victim(requests.waiting, requests.running, rows)) is not None:
            self.results.resolve_inflight()
            if victim in requests.running:
                requests.retract(victim)
        adder = PrefillAdder(
            memory_left=lambda: self.allocator.available_size() + self.cache.evictable_size(),
            running_reserve=sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) for r in requests.running)
            * self.new_token_ratio.value,
            new_token_ratio=self.new_token_ratio.value,
            max_prefill_tokens=self.max_prefill_tokens,
            chunk_size=self.chunk_size,
            page_size=self.allocator.page_size,
        )
        entries: list[Entry] = []
        order = self.fair_share.order(self.policy.order(requests.waiting), requests.running, rows)
        chunked = requests.chunked_req
        # Another tenant's short request may go before the next chunk of a long prompt (scheduler/fair_share.py).
        ahead = self.fair_share.ahead_of_chunk(chunked, order, [*requests.running, *([chunked] if chunked else [])],
                                               self.max_running, adder.rem_chunk_tokens)
        self._admit_in_order(ahead, adder, entries, rows)
        if chunked is not None and not self._extend(chunked, chunked.kv_len, adder, entries) and not entries:
            return None
        chunk_left_out = chunked is not None and all(entry[0] is not chunked for entry in entries)
        self._admit_in_order([req for req in order if req not in ahead], adder, entries,
                             self.max_running - chunk_left_out)
        if not entries:
            return None
        # What this batch computes goes into the tree now (locked by its requests), so the next batch can share
        # it even before this one has run: any batch that reads it runs after this one.
        for req, *_ in entries:
            self.cache.cache_unfinished_req(req, req.all_ids[: req.kv_len])

        admitted = {id(entry[0]) for entry in entries}
        requests.waiting = [req for req in requests.waiting if id(req) not in admitted]
        # A chunked request left out of this batch (others went first) keeps its place for the next one.
        requests.chunked_req = chunked if chunked is not None and id(chunked) not in admitted else None
        decodes, decode_slots = self.decode.mixed_decodes() if self.mixed_chunk else ([], None)
        for req, *_ in entries:
            if req.kv_len < req.fill_len():
                requests.chunked_req = req
            else:
                requests.running.append(req)
        mode = ForwardMode.MIXED if decodes else ForwardMode.EXTEND
        if logger.isEnabledFor(logging.INFO):
            logger.info(prefill_log_line(len(entries), sum(e[2] for e in entries), sum(e[1] for e in entries),
                                         used_kv_tokens(self.allocator, self.cache), self.allocator.size,
                                         len(requests.running), len(requests.waiting)))
        return self.builder.make(mode, entries, decodes, decode_slots)

    def _admit_in_order(self, reqs: list[Req], adder: PrefillAdder, entries: list[Entry], rows: int) -> None:
        """Admit waiting requests in the order given while the batch, the running requests and the rows allow."""
        running = self.requests.running
        for req in reqs:
            if adder.stopped or len(running) + len(entries) >= rows:
                break
            if not self.lora.fits(req, itertools.chain(running, (entry[0] for entry in entries))):
                continue
            if self.req_to_token_pool.available_size() == 0 or self._admit(req, adder, entries) is False:
                break

    def _admit(self, req: Req, adder: PrefillAdder, entries: list[Entry]) -> Optional[bool]:
        """Match `req`'s cached prefix, lock it, take a row and slots for its first (or only) chunk.

        Returns True when admitted, False when the batch is full, None when `req` waits for the next batch
        because a request already in this batch computes a longer part of its prefix.
        """
        fill_len = req.fill_len()
        # Keep at least one token to compute, so the batch yields the logits of the next token.
        key = req.all_ids[: reusable_prefix(req, prefix_limit(req, fill_len - 1), self.pooling_reuses_prefix)]
        match = self.cache.match_prefix(key, req.namespace)
        match = self.cache.load_back(match)  # KV demoted to a lower tier returns to the device before the extend
        if _longest_in_batch_prefix(key, req.namespace, entries) >= match.length + IN_BATCH_PREFIX_MIN_GAIN:
            return None
        self.cache.inc_lock_ref(match.last_node)
        row = self.req_to_token_pool.alloc()
        req.req_pool_idx, req.prefix_indices, req.last_node = row, match.indices, match.last_node
        req.kv_len = match.length
        if match.length:
            table = self.req_to_token_pool.req_to_token
            table[row, : match.length] = match.indices.to(table.device, table.dtype)
        if not self._extend(req, match.length, adder, entries):
            self.cache.dec_lock_ref(match.last_node)
            self.req_to_token_pool.free(row)
            req.reset_kv_state()
            return False
        if req.num_cached_tokens is None:
            req.on_first_admission(match.length)
            self.stats.on_admitted(req.prompt_len, match.length)
        return True

    def _extend(self, req: Req, prefix_len: int, adder: PrefillAdder, entries: list[Entry]) -> bool:
        """Plan and allocate the next extend of a request that holds a row; False when it does not fit."""
        fill_len = req.fill_len()
        extend_len = adder.plan(req, prefix_len, fill_len)
        if extend_len == 0:
            return False
        slots = allocate_slots(self.allocator, self.cache, self.req_to_token_pool, [req.req_pool_idx],
                               [prefix_len], [extend_len])
        if slots is None:
            adder.stopped = True
            return False
        adder.commit(req, extend_len, fill_len, prefix_len)
        req.kv_len = prefix_len + extend_len
        entries.append((req, prefix_len, extend_len, slots))
        return True


def _longest_in_batch_prefix(key: list[int], namespace: tuple, entries: list[Entry]) -> int:
    """Longest common prefix of `key` with the tokens computed so far by the batch's requests (same namespace)."""
    best = 0
    for other, *_ in entries:
        if other.namespace == namespace:
            other_ids = other.all_ids
            best = max(best, common_prefix_length(other_ids[: other.kv_len], key, 0, len(key)))
    return best
