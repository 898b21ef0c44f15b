"""The radix cache of hybrid models: KV for the attention layers and state snapshots for the recurrent ones.

A prefix of a hybrid model can be resumed only where both exist: the KV of its tokens (the tree's values, as in
`RadixCache`) and a snapshot of every linear layer's state after its last token (radix_cache/state_pool.py). The
tree stores snapshots at the ends of nodes, at the boundaries it chooses:

- every extend of a request (each prefill chunk, the end of each prompt, and one token before the end of each
  prompt, where the same prompt again resumes): `cache_unfinished_req` gives the node ending there a snapshot slot
  and the request carries it (`pending_snapshot`, `pending_snapshot_before_last`); the batch that computes those
  tokens writes the state into it (scheduler/hybrid_state.py), so nothing reads it before it is written;
- the end of a finished or retracted request: `cache_finished_req` copies the request's state (its row's working
  slot) into a snapshot at the end of the tokens it inserts, so the next turn of a conversation resumes there.

`match_prefix` returns the longest cached prefix that ends on a node with a snapshot. Snapshots have their own LRU
and budget (the pool's snapshot slots): when none is free, the least recently used snapshot of an unlocked node is
dropped (its node keeps its KV, and matches fall back to the snapshot above it). A locked node's snapshot stays, so
a running request's resume point and pending writes are safe. Evicting a node's KV, flushing and dropping a
namespace free its snapshot with it; a split leaves the snapshot on the lower part, which still ends where it did.

Accounting: every snapshot slot is free or held by exactly one node (`check_invariants`).
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch

from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.state_pool import StatePool
from radixserve.radix_cache.tree import RadixCache

NO_SNAPSHOT = -1


class HybridTreeNode(TreeNode):
    """A tree node that may hold a snapshot of the recurrent states after its last token."""

    __slots__ = ("state_slot",)

    def __init__(self, key: list, value: torch.Tensor, parent: Optional["TreeNode"], namespace: Optional[tuple]):
        super().__init__(key, value, parent, namespace)
        self.state_slot = NO_SNAPSHOT


class HybridRadixCache(RadixCache):
    node_class = HybridTreeNode

    def __init__(self, req_to_token_pool: Any, allocator: Any, state_pool: StatePool, page_size: int = 1,
                 eviction_policy: str = "lru"):
        self.state_pool = state_pool
        # Nodes holding a snapshot, least recently used first.
        self._snapshots: collections.OrderedDict[HybridTreeNode, None] = collections.OrderedDict()
        super().__init__(req_to_token_pool, allocator, page_size, eviction_policy)

    # ---- matching ------------------------------------------------------------------------------------
    def _resume_point(self, ns_root: TreeNode, token_ids: list[int], match: MatchResult) -> MatchResult:
        """The longest prefix of `match` that ends on a state snapshot."""
        node, length = match.last_node, match.length
        while node.key and node.state_slot == NO_SNAPSHOT:
            length -= len(node.key)
            node = node.parent
        if node.key:
            self._snapshots.move_to_end(node)
        return MatchResult(match.indices[:length], node, length)

    def state_snapshot(self, node: HybridTreeNode, depth: int) -> int:
        """The snapshot slot at `depth` tokens on the path to `node` (locked by its request), NO_SNAPSHOT if none."""
        length = sum(len(n.key) for n in _path(node))
        while node.key and length > depth:
            length -= len(node.key)
            node = node.parent
        return node.state_slot if node.key and length == depth else NO_SNAPSHOT

    # ---- request-level operations --------------------------------------------------------------------
    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """As `RadixCache.cache_unfinished_req`, and the node ending after `token_ids` gets a snapshot slot that the
        batch computing them fills (`req.pending_snapshot`; NO_SNAPSHOT when the node has one or none is free).

        When `token_ids` complete the prompt, the node ending one token earlier gets one too
        (`req.pending_snapshot_before_last`): a match keeps the last token of a prompt to compute, so the same prompt
        again resumes there."""
        own_start = len(req.prefix_indices)
        super().cache_unfinished_req(req, token_ids)
        req.pending_snapshot = req.pending_snapshot_before_last = NO_SNAPSHOT
        num_tokens = len(token_ids)
        if not token_ids or len(req.prefix_indices) != num_tokens:  # its unaligned tail is not in the tree
            return
        node = req.last_node
        if node.key and node.state_slot == NO_SNAPSHOT:
            req.pending_snapshot = self._attach_snapshot(node)
        before_last = num_tokens - 1
        if num_tokens == req.fill_len() and before_last > own_start and before_last % self.page_size == 0:
            ns_root = self._namespace_root(req.namespace, create=False)
            inner = self._match(ns_root, token_ids, before_last, touch=False).last_node  # splits the node there
            if inner.state_slot == NO_SNAPSHOT:
                req.pending_snapshot_before_last = self._attach_snapshot(inner)

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """As `RadixCache.cache_finished_req`, and the request's state after `token_ids` becomes the snapshot at
        their end (where its state covers exactly those tokens and they fill whole pages)."""
        row = req.req_pool_idx
        resumable = (not req.kv_unwritten and token_ids and req.state_len == len(token_ids)
                     and len(token_ids) % self.page_size == 0)
        super().cache_finished_req(req, token_ids)
        if not resumable:
            return
        match = self._match(self._namespace_root(req.namespace, create=False), token_ids, len(token_ids), touch=False)
        node = match.last_node
        assert match.length == len(token_ids), "a finished request's tokens must be in the tree after its insert"
        if node.state_slot == NO_SNAPSHOT and (slot := self._attach_snapshot(node)) != NO_SNAPSHOT:
            self.state_pool.copy(row, slot)

    # ---- snapshots -----------------------------------------------------------------------------------
    def _attach_snapshot(self, node: HybridTreeNode) -> int:
        slot = self.state_pool.alloc_snapshot()
        if slot is None and self.evict_snapshots(1):
            slot = self.state_pool.alloc_snapshot()
        if slot is None:
            return NO_SNAPSHOT
        node.state_slot = slot
        self._snapshots[node] = None
        return slot

    def evict_snapshots(self, num: int) -> int:
        """Drop up to `num` snapshots of unlocked nodes, least recently used first; returns how many."""
        dropped = []
        for node in self._snapshots:
            if len(dropped) == num:
                break
            if node.lock_ref == 0:
                dropped.append(node)
        for node in dropped:
            self._evict_snapshot(node)
        return len(dropped)

    def _evict_snapshot(self, node: HybridTreeNode) -> None:
        """Take a snapshot off the device for want of slots (the hierarchical cache keeps a host copy first)."""
        self._drop_snapshot(node)

    def _drop_snapshot(self, node: HybridTreeNode) -> None:
        self.state_pool.free_snapshot(node.state_slot)
        node.state_slot = NO_SNAPSHOT
        del self._snapshots[node]

    def num_snapshots(self) -> int:
        return len(self._snapshots)

    # ---- tree maintenance ----------------------------------------------------------------------------
    def _delete_leaf(self, leaf: TreeNode) -> TreeNode:
        if leaf.state_slot != NO_SNAPSHOT:
            self._drop_snapshot(leaf)
        return super()._delete_leaf(leaf)

    def reset(self) -> None:
        super().reset()  # refuses while anything is locked, before any snapshot is dropped
        for node in list(self._snapshots):
            self._drop_snapshot(node)

    def check_invariants(self, held_slots: int = 0) -> None:
        """`RadixCache.check_invariants`, and every snapshot slot free or held by exactly one node in the tree."""
        super().check_invariants(held_slots)
        in_tree = {node for node in self._nodes() if node.state_slot != NO_SNAPSHOT}
        if in_tree != set(self._snapshots):
            raise AssertionError("radix cache invariant violated: the snapshot LRU does not list exactly the nodes "
                                 "holding a snapshot")
        try:
            self.state_pool.check_invariants(node.state_slot for node in in_tree)
        except AssertionError as exc:
            raise AssertionError(f"radix cache invariant violated: {exc}") from None


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.key:
        out.append(node)
        node = node.parent
    return out
