"""Prefix-cache statistics per namespace, for metrics: tokens queried, matched, inserted and evicted.

Counters are cumulative over the cache's life (a flush does not reset them), like Prometheus counters.
Namespaces come from clients (every `cache_salt` is one), so the per-namespace table is bounded: it keeps the
`max_namespaces` most recently used and folds the counters of the one it drops into the overall totals, which
stay cumulative. A dropped namespace that comes back starts again from zero.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Optional

MAX_NAMESPACES = 1024


@dataclass
class NamespaceStats:
    queried_tokens: int = 0  # tokens passed to match_prefix
    matched_tokens: int = 0  # of those, tokens found in the cache (the hits)
    inserted_tokens: int = 0  # tokens newly added to the tree
    evicted_tokens: int = 0  # tokens removed by eviction

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}

    def add(self, other: "NamespaceStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class CacheStats:
    """One `NamespaceStats` per namespace tuple, for the `max_namespaces` most recently used ones."""

    def __init__(self, max_namespaces: int = MAX_NAMESPACES) -> None:
        self.max_namespaces = max_namespaces
        self._by_namespace: OrderedDict[tuple, NamespaceStats] = OrderedDict()
        self._dropped = NamespaceStats()  # the counters of the namespaces dropped from the table
        self._num_dropped = 0

    def of(self, namespace: tuple) -> NamespaceStats:
        """The counters of `namespace`, to update at once (a later call may drop them from the table)."""
        stats = self._by_namespace.get(namespace)
        if stats is not None:
            self._by_namespace.move_to_end(namespace)
            return stats
        stats = self._by_namespace[namespace] = NamespaceStats()
        while len(self._by_namespace) > self.max_namespaces:
            _, oldest = self._by_namespace.popitem(last=False)
            self._dropped.add(oldest)
            self._num_dropped += 1
        return stats

    def as_dict(self) -> dict:
        """`{"namespaces": {namespace: counters}, **overall counters, "dropped_namespaces": n}`; each counter set
        has a `hit_rate`."""
        total = NamespaceStats()
        total.add(self._dropped)
        for stats in self._by_namespace.values():
            total.add(stats)
        return {
            "namespaces": {namespace: stats.as_dict() for namespace, stats in self._by_namespace.items()},
            **total.as_dict(),
            "dropped_namespaces": self._num_dropped,
        }


@dataclass
class TierCounters:
    """Cumulative token counts of the hierarchical cache's moves between tiers."""

    backed_up_tokens: int = 0  # device -> host copies (write-through backups and demotions)
    loaded_from_host_tokens: int = 0  # host -> device copies of `load_back`
    written_to_disk_tokens: int = 0  # demotions to the disk tier
    loaded_from_disk_tokens: int = 0  # disk -> device copies of `load_back`
    dropped_tokens: int = 0  # lower-tier tokens removed from the tree for want of room


@dataclass
class LowerTierInfo:
    """The hierarchical cache's host and disk tiers, for `get_server_info()` (see scheduler/info.py)."""

    write_policy: str
    host_total_tokens: int
    host_used_tokens: int
    host_free_tokens: int
    host_bytes_per_token: int
    disk_used_tokens: int  # tokens in the disk tier's files (0 without a disk tier)
    disk_capacity_tokens: Optional[int]  # None: unbounded, or no disk tier
    counters: TierCounters
