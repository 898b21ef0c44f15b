"""A prefix cache that never shares, for `--disable-radix-cache`: the PrefixCache interface, caching nothing.

Every request computes its whole prompt and owns every slot of its KV until it finishes, when
`cache_finished_req` frees them all. Useful as the baseline the radix cache is compared against, and to rule the
tree out when debugging.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.radix_cache.base import MatchResult, PrefixCache
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.stats import CacheStats


class NoShareCache(PrefixCache):
    """Nothing is ever cached: matches are empty, sizes are zero, locks and eviction are no-ops."""

    def __init__(self, req_to_token_pool: Any, allocator: Any, page_size: int = 1, eviction_policy: str = "lru"):
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} differs from the allocator's {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=self.device), None, None)
        self._stats = CacheStats()

    def match_prefix(self, token_ids: list[int], namespace: tuple = ()) -> MatchResult:
        """Always an empty match ending at the root (which needs no lock)."""
        self._check_namespace(namespace)
        self._stats.of(namespace).queried_tokens += len(token_ids)
        return MatchResult(self.root.value, self.root, 0)

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: tuple = ()) -> int:
        """Takes no ownership: reports the whole page-aligned key as present, so the caller, following the
        `RadixCache.insert` contract, frees all of its slots itself."""
        self._check_namespace(namespace)
        return len(token_ids) - len(token_ids) % self.page_size

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """Free every slot of the request's KV, `req_to_token[req.req_pool_idx, :len(token_ids)]`."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :len(token_ids)]
        self.allocator.free(row.to(torch.int64))

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """Nothing to do: the request keeps owning all of its KV (`req.prefix_indices` stays empty)."""

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        """Nothing is cached, so nothing to flush."""

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def stats(self) -> dict:
        return self._stats.as_dict()

    def check_invariants(self, held_slots: int = 0) -> None:
        """All slots are either free or held by running requests: `allocator.size == free + held_slots`."""
        free = self.allocator.available_size()
        if self.allocator.size != free + held_slots:
            raise AssertionError(
                f"slot accounting: size {self.allocator.size} != free {free} + held {held_slots} (no-share cache)"
            )

    @staticmethod
    def _check_namespace(namespace: tuple) -> None:
        if type(namespace) is not tuple:
            raise TypeError(f"a cache namespace is a tuple, got {type(namespace).__name__}")
