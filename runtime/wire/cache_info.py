"""The KV pool's and the prefix cache's part of a scheduler's report (`ServerInfo.memory` and `ServerInfo.cache`,
runtime/wire/server_info.py): token slots per state and per tier, the cache's hit counters overall and per
namespace, and the hierarchical cache's moves between tiers; each struct merges the replicas' by server_info.py's
rules.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import msgspec

from radixserve.runtime.wire.replica_merge import _kept_once, _sum, _summed


class LowerTierMemory(msgspec.Struct, kw_only=True):
    """The hierarchical cache's host and disk tiers, in tokens (`host_total == host_free + host_used`)."""

    host_total_tokens: int
    host_used_tokens: int
    host_free_tokens: int
    host_bytes_per_token: int  # kept once
    disk_used_tokens: int  # 0 without a disk tier
    disk_capacity_tokens: Optional[int]  # None: unbounded, or no disk tier

    @classmethod
    def merge(cls, parts: Sequence["LowerTierMemory"]) -> "LowerTierMemory":
        capacities = [p.disk_capacity_tokens for p in parts]
        return cls(host_total_tokens=_sum(parts, "host_total_tokens"), host_used_tokens=_sum(parts, "host_used_tokens"),
                   host_free_tokens=_sum(parts, "host_free_tokens"),
                   host_bytes_per_token=_kept_once([p.host_bytes_per_token for p in parts], "host_bytes_per_token"),
                   disk_used_tokens=_sum(parts, "disk_used_tokens"),
                   disk_capacity_tokens=None if None in capacities else sum(capacities))


class MemoryInfo(msgspec.Struct, kw_only=True):
    """KV token slots: `free + evictable + protected + held by running requests == total`."""

    total_tokens: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    lower_tiers: Optional[LowerTierMemory] = None  # with the hierarchical cache

    @property
    def token_usage(self) -> float:
        """The share of slots that neither are free nor could be freed by eviction."""
        used = self.total_tokens - self.free_tokens - self.evictable_tokens
        return used / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The slot counts, the lower tiers' figures beside them."""
        out = msgspec.structs.asdict(self)
        tiers = out.pop("lower_tiers")
        return out if tiers is None else {**out, **msgspec.structs.asdict(tiers)}

    @classmethod
    def merge(cls, parts: Sequence["MemoryInfo"]) -> "MemoryInfo":
        tiers = [p.lower_tiers for p in parts if p.lower_tiers is not None]
        return cls(total_tokens=_sum(parts, "total_tokens"), free_tokens=_sum(parts, "free_tokens"),
                   evictable_tokens=_sum(parts, "evictable_tokens"), protected_tokens=_sum(parts, "protected_tokens"),
                   lower_tiers=LowerTierMemory.merge(tiers) if tiers else None)


class NamespaceCounters(msgspec.Struct, kw_only=True):
    """One namespace's prefix-cache counters (radix_cache/stats.py); every field is a count."""

    queried_tokens: int = 0  # tokens looked up in the tree
    matched_tokens: int = 0  # of those, found (the hits)
    inserted_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self), "hit_rate": self.hit_rate}


class TreeCounters(NamespaceCounters, kw_only=True):
    """The tree's counters over every namespace, those dropped from the per-namespace table included."""

    dropped_namespaces: int = 0


class HiCacheInfo(msgspec.Struct, kw_only=True):
    """The hierarchical cache's moves between tiers, in tokens (cumulative), and its write policy (kept once)."""

    write_policy: str
    backed_up_tokens: int
    loaded_from_host_tokens: int
    written_to_disk_tokens: int
    loaded_from_disk_tokens: int
    dropped_tokens: int

    @classmethod
    def merge(cls, parts: Sequence["HiCacheInfo"]) -> "HiCacheInfo":
        policy = _kept_once([p.write_policy for p in parts], "write_policy")
        return _summed(cls, parts, write_policy=policy)


class CacheInfo(msgspec.Struct, kw_only=True):
    """`matched_tokens` / `queried_tokens`: prompt tokens at each request's first admission and those served from
    the cache (the server's hit rate); `tree`: every match query; `namespaces`: the same per namespace (named by
    `cache_tree.namespace_name`, the most recently used ones)."""

    matched_tokens: int
    queried_tokens: int
    tree: TreeCounters
    namespaces: dict[str, NamespaceCounters]
    hicache: Optional[HiCacheInfo] = None

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hit_rate": self.hit_rate, "matched_tokens": self.matched_tokens,
                               "queried_tokens": self.queried_tokens, "tree": self.tree.to_dict(),
                               "namespaces": {name: c.to_dict() for name, c in self.namespaces.items()}}
        if self.hicache is not None:
            out["hicache"] = msgspec.structs.asdict(self.hicache)
        return out

    @classmethod
    def merge(cls, parts: Sequence["CacheInfo"]) -> "CacheInfo":
        names = dict.fromkeys(name for p in parts for name in p.namespaces)
        namespaces = {name: _summed(NamespaceCounters, [p.namespaces[name] for p in parts if name in p.namespaces])
                      for name in names}
        hicache = [p.hicache for p in parts if p.hicache is not None]
        return cls(matched_tokens=_sum(parts, "matched_tokens"), queried_tokens=_sum(parts, "queried_tokens"),
                   tree=_summed(TreeCounters, [p.tree for p in parts]), namespaces=namespaces,
                   hicache=HiCacheInfo.merge(hicache) if hicache else None)
