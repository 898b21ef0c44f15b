"""The radix cache of sliding-window models whose window layers have a slot space of their own (swa_pool.py).

A node keeps its tokens' full slots as `RadixCache` does; each full slot may or may not still have its window slot
(`SWAKVAllocator.full_to_window`, 0 once gone). Window KV leaves the tree in two ways:

- a running request frees the window slots of tokens that left its window (scheduler/window_release.py), on the
  nodes of its path that no one else holds (`lock_ref == 1`, its own lock only): a node another running request or a
  retained session holds keeps its window KV, since that holder may resume right after it. Nor does it free the
  W - 1 positions before a resume point: the end of a node marked `resume_point`, where a later request is expected
  to resume. Two are marked per request, as a hybrid linear-attention model places its state snapshots
  (radix_cache/hybrid.py): one token before the end of its prompt (the same prompt again resumes there, a match
  leaving the last token to compute) and the end of its tokens when it finishes (the next turn of a conversation);
- when window slots are short, `evict_window` drops the window KV of unlocked nodes, least recently used first; their
  full KV stays.

A prefix is resumable at position P only when the window KV of the W - 1 positions before P is there (W the largest
window): the query at P reads those. `match_prefix` returns the longest such prefix, so a hit computes exactly what a
miss would. The tokens after it may still be in the tree (window-less): the request computes them again, and when
its copies are found duplicates (`cache_unfinished_req`), their window slots go to the tree's slots instead of being
freed; the batch writes the window layers' K/V through the request's row, which names the tree's slots by then
(`ForwardBatch.window_write_slots`), so the tree's tokens get their window KV back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.swa_pool import SWAKVAllocator
from radixserve.radix_cache.tree import RadixCache


class SWATreeNode(TreeNode):
    """A tree node that may be a resume point: the window KV of the W - 1 positions before its end is kept."""

    __slots__ = ("resume_point",)

    def __init__(self, key: list, value: torch.Tensor, parent: Optional["TreeNode"], namespace: Optional[tuple]):
        super().__init__(key, value, parent, namespace)
        self.resume_point = False


class SWARadixCache(RadixCache):
    node_class = SWATreeNode

    def __init__(self, req_to_token_pool: Any, allocator: SWAKVAllocator, window: int, eviction_policy: str = "lru"):
        super().__init__(req_to_token_pool, allocator, 1, eviction_policy)
        self.window = window  # the largest window of the model's layers

    # ---- matching ------------------------------------------------------------------------------------
    def _resume_point(self, ns_root: TreeNode, token_ids: list[int], match: MatchResult) -> MatchResult:
        """The longest prefix of `match` whose last W - 1 tokens still have window KV."""
        length = self.resumable_length(match.indices)
        if length < match.length:
            match = self._match(ns_root, token_ids, length, touch=False)  # ends on a node there (splits it)
        return match

    def resumable_length(self, slots: torch.Tensor) -> int:
        """The largest P <= len(slots) such that `slots[P - W + 1:P]` all have window KV (0 always qualifies): the
        last token without window KV before P must lie W positions or more before it."""
        has_window = self.allocator.has_window(slots)
        if has_window.numel() == 0:
            return 0
        positions = torch.arange(has_window.numel())
        last_gone = torch.where(has_window, -1, positions).cummax(0).values  # at or before each position
        ends = positions + 1
        resumable = ends[(last_gone < 0) | (ends - last_gone >= self.window)]
        return int(resumable[-1]) if resumable.numel() else 0

    # ---- window KV -----------------------------------------------------------------------------------
    def release_window(self, req: Any, start: int, end: int) -> int:
        """Free the window KV of the tree's tokens `[start, end)` of `req`'s prefix, in the nodes of its path that only
        `req` holds, but for the W - 1 positions before each resume point on the path; returns the window slots
        freed."""
        path = []  # (node, its first position, its end), from the request's last node up
        node, node_end = req.last_node, len(req.prefix_indices)
        while node.key:
            path.append((node, node_end - len(node.key), node_end))
            node, node_end = node.parent, node_end - len(node.key)
        kept = [(max(0, node_end - self.window + 1), node_end) for node, _, node_end in path if node.resume_point]
        parts = []
        for node, node_start, node_end in path:
            lo, hi = max(start, node_start), min(end, node_end)
            if node.lock_ref != 1 or lo >= hi:
                continue
            free = torch.ones(hi - lo, dtype=torch.bool)
            for keep_lo, keep_hi in kept:
                if max(keep_lo, lo) < min(keep_hi, hi):
                    free[max(keep_lo, lo) - lo:min(keep_hi, hi) - lo] = False
            slots = node.value[lo - node_start:hi - node_start]
            parts.append(slots[free.to(slots.device)])
        return self.allocator.release_window(torch.cat(parts)) if parts else 0

    def evict_window(self, num_tokens: int) -> int:
        """Free the window KV of unlocked nodes, least recently used first, until `num_tokens` window slots were freed
        or none is left; their full KV stays. Returns the window slots freed."""
        freed = 0
        for node in sorted((n for n in self._nodes() if n.lock_ref == 0), key=lambda n: n.last_access):
            freed += self.allocator.release_window(node.value)
            if freed >= num_tokens:
                break
        return freed

    # ---- resume points -------------------------------------------------------------------------------
    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """As `RadixCache.cache_unfinished_req`; when `token_ids` complete the prompt, the node ending one token before
        its end becomes a resume point."""
        super().cache_unfinished_req(req, token_ids)
        if len(token_ids) > 1 and len(req.prefix_indices) == len(token_ids) == req.fill_len():
            self._mark_resume_point(req.namespace, token_ids, len(token_ids) - 1)

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """As `RadixCache.cache_finished_req`, and the end of the request's tokens becomes a resume point."""
        written = not req.kv_unwritten
        super().cache_finished_req(req, token_ids)
        if written and token_ids:
            self._mark_resume_point(req.namespace, token_ids, len(token_ids))

    def _mark_resume_point(self, namespace: tuple, token_ids: list[int], length: int) -> None:
        ns_root = self._namespace_root(namespace, create=False)
        if ns_root is None:
            return
        match = self._match(ns_root, token_ids, length, touch=False)  # ends on a node there (splits it)
        if match.length == length:
            match.last_node.resume_point = True

    def _adopt_duplicates(self, own_slots: torch.Tensor, tree_slots: torch.Tensor) -> None:
        self.allocator.adopt_window(tree_slots, own_slots)
