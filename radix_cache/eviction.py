"""Eviction order of the radix tree's unlocked leaves: least recently used (LRU) or least frequently used (LFU).

The queue is a lazy min-heap. Rebuilding a heap of every leaf on each `evict` call would cost time in the size
of the tree; instead the tree pushes a node whenever it *becomes* an evictable leaf or its priority changes while
it is one, and `pop` discards entries that went stale in the meantime. An entry is live when it is the node's most
recent push (`node.heap_seq`) and the node is still an evictable leaf, so each node has at most one live entry.

Nodes are duck-typed: they need `last_access`, `hit_count`, a writable `heap_seq` and `is_evictable_leaf()`.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Any, Callable, Optional

EVICTION_POLICIES = ("lru", "lfu")

# Stale entries are dropped by a rebuild once the heap exceeds this many entries beyond twice the node count,
# which keeps memory bounded and costs O(1) amortized per push.
_COMPACT_SLACK = 1024


def _lru_priority(node: Any) -> tuple:
    return (node.last_access,)


def _lfu_priority(node: Any) -> tuple:
    # Fewest hits first; among equally used leaves, the least recently used.
    return (node.hit_count, node.last_access)


class EvictionQueue:
    """Evictable leaves, lowest priority first. `policy` is "lru" or "lfu"."""

    def __init__(self, policy: str = "lru") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {EVICTION_POLICIES}")
        self.policy = policy
        self._priority: Callable[[Any], tuple] = _lru_priority if policy == "lru" else _lfu_priority
        self._heap: list[tuple] = []
        self._seq = count()

    def __len__(self) -> int:
        """Entries in the heap, stale ones included."""
        return len(self._heap)

    def push(self, node: Any, num_nodes: int) -> None:
        """(Re)queue `node` with its current priority; any earlier entry of it becomes stale.

        `num_nodes` is the tree's node count, used to decide when stale entries are worth dropping.
        """
        seq = next(self._seq)
        self._stamp(node, seq)
        # The unique sequence number breaks ties before the node itself would be compared.
        heapq.heappush(self._heap, (*self._priority(node), seq, node))
        if len(self._heap) > 2 * num_nodes + _COMPACT_SLACK:
            self._compact()

    def pop(self) -> Optional[Any]:
        """Remove and return the live entry of lowest priority, or None when no evictable leaf is queued."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            node = entry[-1]
            if self._is_live(entry):
                self._stamp(node, -1)
                return node
        return None

    def live_nodes(self) -> list[Any]:
        """Nodes with a live entry (for invariant checks; O(heap size))."""
        return [entry[-1] for entry in self._heap if self._is_live(entry)]

    def clear(self) -> None:
        self._heap = []

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if self._is_live(entry)]
        heapq.heapify(self._heap)

    # A queue over another set of candidates (the hierarchical cache's host and disk tiers) overrides these two.
    @staticmethod
    def _is_live(entry: tuple) -> bool:
        node = entry[-1]
        return entry[-2] == node.heap_seq and node.is_evictable_leaf()

    @staticmethod
    def _stamp(node: Any, seq: int) -> None:
        node.heap_seq = seq
