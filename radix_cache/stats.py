"""Prefix-cache statistics per namespace, for metrics: tokens queried, matched, inserted and evicted.

Counters are cumulative over the cache's life (a flush does not reset them), like Prometheus counters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


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


class CacheStats:
    """One `NamespaceStats` per namespace tuple seen so far."""

    def __init__(self) -> None:
        self._by_namespace: dict[tuple, NamespaceStats] = {}

    def of(self, namespace: tuple) -> NamespaceStats:
        stats = self._by_namespace.get(namespace)
        if stats is None:
            stats = self._by_namespace[namespace] = NamespaceStats()
        return stats

    def as_dict(self) -> dict:
        """`{"namespaces": {namespace: counters}, **overall counters}`; each counter set has a `hit_rate`."""
        total = NamespaceStats()
        for stats in self._by_namespace.values():
            total.queried_tokens += stats.queried_tokens
            total.matched_tokens += stats.matched_tokens
            total.inserted_tokens += stats.inserted_tokens
            total.evicted_tokens += stats.evicted_tokens
        return {
            "namespaces": {namespace: stats.as_dict() for namespace, stats in self._by_namespace.items()},
            **total.as_dict(),
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
