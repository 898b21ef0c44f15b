"""The prefix cache's interface: what the scheduler may ask of a cache, whatever it shares.

Two caches implement it: `RadixCache` (the token-granular radix tree) and `NoShareCache` (`--disable-radix-cache`,
shares nothing). The scheduler holds a `PrefixCache` and never asks which one it has.

Ownership of KV slots, the contract every implementation keeps:
- a match's `indices` belong to the cache; they stay valid only while `last_node` is locked (`inc_lock_ref`),
  and a locked node is never evicted;
- `insert` takes the slots of the tokens it did not have; the caller keeps (and frees) the others;
- `cache_finished_req` takes a finished request's whole KV: what the cache keeps it owns, the rest it frees; the
  request's lock is released. `cache_unfinished_req` does the same for what a running request has computed so
  far, keeping it locked;
- accounting: `allocator.size == free + evictable_size() + protected_size() + held`, where `held` counts slots
  owned only by running requests; `check_invariants(held)` raises AssertionError when it does not hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Optional

import torch


class MatchResult(NamedTuple):
    indices: torch.Tensor  # int64 KV slots of the matched tokens; valid while `last_node` is locked
    last_node: Any  # the cache's handle on the deepest matched node (a root when nothing matched); lock it
    length: int  # matched tokens, a multiple of page_size
    # A cache with lower tiers (hiradix.py) also finds tokens whose KV was demoted to the host or disk:
    # `host_hit_length` more tokens after `length`, ending at `last_host_node`; `load_back` brings them back.
    host_hit_length: int = 0
    last_host_node: Any = None


class PrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(self, token_ids: list[int], namespace: tuple = ()) -> MatchResult:
        """The longest cached prefix of `token_ids` in `namespace`, in whole pages."""

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: tuple = ()) -> int:
        """Cache the page-aligned part of `token_ids` (KV in `slots`); returns how many tokens were present."""

    @abstractmethod
    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """Take a finished (aborted, retracted) request's KV for `token_ids` and release its lock."""

    @abstractmethod
    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """Cache what a running request has computed so far, keeping it locked (chunked prefill)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protect `node` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undo one `inc_lock_ref`."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots of unlocked entries if there are that many; returns how many."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (only when nothing is locked)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots of unlocked entries."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots of locked entries."""

    @abstractmethod
    def total_size(self) -> int:
        """Slots the cache holds."""

    def continuation(self, token_ids: list[int], namespace: tuple, max_tokens: int) -> list[int]:
        """Up to `max_tokens` cached tokens that follow the whole of `token_ids` in `namespace` (speculative
        drafts); read-only. A cache that shares nothing knows none."""
        return []

    def lock_prefix(self, token_ids: list[int], namespace: tuple = ()) -> Optional[tuple[Any, int]]:
        """Lock the cached prefix of `token_ids` for a holder other than a request (a retained session); returns
        (the node to `dec_lock_ref` later, its length) or None when nothing is cached. A cache that shares
        nothing has nothing to keep."""
        return None

    # Where a retained session keeps its prefix (retention.py): on the device, locked, by default; a cache with a
    # host tier keeps it there instead (hiradix.py), leaving the device to the running requests.
    retains_on_device = True

    def retain_prefix(self, token_ids: list[int], namespace: tuple = ()) -> Optional[tuple[Any, int]]:
        """Keep the cached prefix of `token_ids` from eviction for a retained session; returns (the handle to
        `release_prefix` later, its length) or None when nothing of it is cached or it cannot be kept."""
        return self.lock_prefix(token_ids, namespace)

    def release_prefix(self, handle: Any) -> None:
        """Undo one `retain_prefix`."""
        self.dec_lock_ref(handle)

    def retention_budget(self, device_tokens: int) -> int:
        """The most tokens all retained sessions together may keep (each tenant half of it by default): half of the
        device pool of `device_tokens` here, so running requests always have the other half."""
        return device_tokens // 2

    @abstractmethod
    def stats(self) -> dict:
        """Counters, overall and per namespace (radix_cache/stats.py)."""

    @abstractmethod
    def check_invariants(self, held_slots: int = 0) -> None:
        """Raise AssertionError unless the accounting above holds."""

    def evict_namespaces(self, selected: Callable[[tuple], bool]) -> int:
        """Free the unlocked entries of every namespace `selected` picks (an unloaded LoRA adapter's); returns
        the slots freed. A cache that keeps nothing across requests has nothing to drop."""
        return 0

    def state_snapshot(self, node: Any, depth: int) -> int:
        """The recurrent-state snapshot slot at `depth` tokens on the path to `node` (hybrid models, radix_cache/
        hybrid.py); -1 when there is none, always for a cache that keeps no snapshots."""
        return -1

    def release_window(self, req: Any, start: int, end: int) -> int:
        """Free the window KV of positions `[start, end)` of `req`'s cached prefix where no one else may read it
        (sliding-window models with a window slot space, radix_cache/swa.py); returns the window slots freed. A cache
        without window slots frees none."""
        return 0

    def evict_window(self, num_tokens: int) -> int:
        """Free at least `num_tokens` window slots of unlocked entries, keeping their full KV, if there are that many;
        returns how many (radix_cache/swa.py). A cache without window slots frees none."""
        return 0

    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring a match's lower-tier part onto the device (see hiradix.py); a one-tier cache returns `match`."""
        return match

    def tree_root(self) -> Optional[Any]:
        """The root node of the cache's tree (nodes with `children` and `parent`), for policies that walk it; None
        for a cache without one."""
        return None

    def lower_tiers(self) -> Optional[Any]:
        """Host and disk tier figures (`stats.LowerTierInfo`); None when the cache has no lower tier."""
        return None
