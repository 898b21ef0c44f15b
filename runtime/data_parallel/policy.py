"""Which replica gets a request (`--load-balance-method`).

- round_robin: in turn.
- shortest_queue: the fewest outstanding requests (sent and not finished).
- minimum_tokens: the fewest outstanding tokens (prompt + max new tokens of those requests).
- cache_aware (default): the replica that holds the longest prefix of the prompt in the request's namespace,
  by the approximate tree of prefix_tree.py, as sglang-router's cache-aware policy does: when the busiest
  replica's load is past both balance thresholds, the least loaded replica instead; when no replica holds at
  least `cache_threshold` of the prompt, the replica believed to cache the least (so new prefixes spread out).

Loads are the controller's estimates (LoadEstimate): what each replica reported plus what was sent since.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence, Union

from radixserve.runtime.data_parallel.prefix_tree import ApproxPrefixTree


@dataclass
class LoadEstimate:
    """One replica's outstanding work as the controller estimates it."""

    requests: int = 0
    tokens: int = 0


Loads = Union[Sequence[LoadEstimate], Mapping[int, LoadEstimate]]  # each candidate replica's load, by its index


class LoadBalancer:
    def __init__(self, method: str, num_replicas: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5,
                 max_tree_tokens: int = 1 << 22) -> None:
        self.method = method
        self.num_replicas = num_replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxPrefixTree(max_tree_tokens)
        self._turn = itertools.count()
        self.decisions = {"cache_hit": 0, "cache_miss": 0, "balance": 0}  # cache_aware's reasons, for metrics

    def choose(self, namespace: tuple, key: Sequence[Hashable], loads: Loads,
               candidates: Optional[Sequence[int]] = None) -> int:
        """The replica for a request of `namespace` whose prompt is `key`; records it in the tree.
        `candidates`: the replicas to choose from (default: 0 .. num_replicas-1); `loads` is indexed by them."""
        replicas = range(self.num_replicas) if candidates is None else candidates
        if self.method == "round_robin":
            return replicas[next(self._turn) % len(replicas)]
        if self.method == "shortest_queue":
            return _argmin(replicas, lambda r: (loads[r].requests, loads[r].tokens))
        if self.method == "minimum_tokens":
            return _argmin(replicas, lambda r: (loads[r].tokens, loads[r].requests))
        replica = self._cache_aware(namespace, key, loads, replicas)
        self.tree.insert(namespace, key, replica)
        return replica

    def _cache_aware(self, namespace: tuple, key: Sequence[Hashable], loads: Loads,
                     replicas: Sequence[int]) -> int:
        least_loaded = _argmin(replicas, lambda r: (loads[r].requests, loads[r].tokens))
        busiest = max(loads[r].requests for r in replicas)
        idlest = loads[least_loaded].requests
        if busiest - idlest > self.balance_abs_threshold and busiest > idlest * self.balance_rel_threshold:
            self.decisions["balance"] += 1
            return least_loaded
        matched = {r: length for r, length in self.tree.match(namespace, key).items() if r in replicas}
        if matched:
            best = _argmin(matched, lambda r: (-matched[r], loads[r].requests, r))
            if key and matched[best] / len(key) >= self.cache_threshold:
                self.decisions["cache_hit"] += 1
                return best
        self.decisions["cache_miss"] += 1
        return _argmin(replicas, lambda r: (self.tree.replica_tokens(r), loads[r].requests, r))

    def chosen(self, namespace: tuple, key: Sequence[Hashable], replica: int) -> None:
        """A request the caller routed itself went to `replica`: keep the picture of its cache right."""
        if self.method == "cache_aware":
            self.tree.insert(namespace, key, replica)

    # ---- what the replicas report ----------------------------------------------------------------
    def evicted(self, replica: int, namespace: tuple, key: Sequence[Hashable], kept: int) -> None:
        self.tree.forget(namespace, key, kept, replica)

    def flushed(self, replica: int) -> None:
        self.tree.drop_replica(replica)


def _argmin(items, key):  # type: ignore[no-untyped-def]
    return min(items, key=key)
