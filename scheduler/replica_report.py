"""A data-parallel replica's reports to the controller (runtime/data_parallel/): its load after each round of
work and the prefixes its radix tree evicted, so the controller's picture of every replica's cache does not
drift from the truth.

The reporter listens to the tree (`RadixCache.eviction_listener`): an evicted leaf is reported as the token
path from its namespace root (what the controller's tree is keyed by) and how much of it is still cached.
A hierarchical cache moves evicted KV to host memory rather than dropping it, so its device evictions are not
reported (the prefix is still served from this replica).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from radixserve.runtime.wire.messages import (
    UNBOUNDED_NEW_TOKENS, EvictedPrefix, ReplicaLoad, TokenizedGenerateReq, encode, request_tokens,
)

REPORT_INTERVAL_S = 0.05  # a replica whose counts did not change still reports this often while busy
MAX_EVICTED_PER_REPORT = 256  # the rest waits for the next report


class ReplicaReporter:
    def __init__(self, dp_rank: int, socket: zmq.Socket, scheduler: Any) -> None:
        self.dp_rank = dp_rank
        self.socket = socket
        self.scheduler = scheduler
        self.received = 0
        self.received_tokens = 0
        self._evicted: list[EvictedPrefix] = []
        self._flushed = False
        self._last: tuple = ()
        self._last_time = 0.0
        if hasattr(scheduler.cache, "eviction_listener") and not scheduler.args.enable_hierarchical_cache:
            scheduler.cache.eviction_listener = self

    # ---- the tree's listener ---------------------------------------------------------------------
    def evicted(self, leaf: Any) -> None:
        self._evicted.append(evicted_prefix(leaf))

    def reset(self) -> None:
        self._evicted.clear()
        self._flushed = True

    # ---- the process loop's hooks ----------------------------------------------------------------
    def received_request(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            self.received += 1
            self.received_tokens += request_tokens(message)

    def after_round(self) -> None:
        """Send a report when something changed (or, while busy, every REPORT_INTERVAL_S)."""
        scheduler = self.scheduler
        queued = list(scheduler.waiting) + ([scheduler.chunked_req] if scheduler.chunked_req is not None else [])
        counts = (self.received, len(scheduler.running), len(queued))
        now = time.monotonic()
        if (counts == self._last and not self._evicted and not self._flushed
                and (scheduler.is_idle() or now - self._last_time < REPORT_INTERVAL_S)):
            return
        outstanding = sum(_outstanding_tokens(req) for req in (*scheduler.running, *queued))
        evicted, self._evicted = self._evicted[:MAX_EVICTED_PER_REPORT], self._evicted[MAX_EVICTED_PER_REPORT:]
        self.socket.send(encode(ReplicaLoad(
            dp_rank=self.dp_rank, received=self.received, received_tokens=self.received_tokens,
            running=counts[1], waiting=counts[2], outstanding_tokens=outstanding, evicted=evicted,
            flushed=self._flushed,
        )))
        self._flushed = False
        self._last, self._last_time = counts, now


def evicted_prefix(leaf: Any) -> EvictedPrefix:
    """A radix-tree leaf about to be evicted, as the controller sees it: its path from the namespace root."""
    keys = []
    node = leaf
    while node.parent is not None and node.key:
        keys.append(node.key)
        node = node.parent
    tokens = [token for key in reversed(keys) for token in key]
    return EvictedPrefix(tuple(leaf.namespace or ()), tokens, len(tokens) - len(leaf.key))


def _outstanding_tokens(req: Any) -> int:
    max_new = req.sampling_params.max_new_tokens
    remaining = UNBOUNDED_NEW_TOKENS if max_new is None else max(0, max_new - len(req.output_ids))
    return len(req.origin_input_ids) + len(req.output_ids) + remaining
