"""The radix tree's node: a run of tokens, the KV slots holding them, and what locking and eviction record on it.

The tree (tree.py) lays nodes out and keeps their fields consistent; subclasses add what another cache keeps per
node (the hierarchical cache's lower tiers, hinode.py; a hybrid model's state snapshot, hybrid.py; window KV,
swa.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class TreeNode:
    """A run of tokens and their KV slots. Roots (the global one and each namespace's) have an empty key."""

    __slots__ = ("children", "parent", "key", "value", "namespace", "lock_ref", "last_access", "hit_count", "heap_seq",
                 "last_access_time")

    def __init__(self, key: list, value: torch.Tensor, parent: Optional["TreeNode"], namespace: Optional[tuple]):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.namespace = namespace
        self.lock_ref = 0
        self.last_access = 0  # logical clock: orders accesses exactly (LRU)
        self.last_access_time = 0.0  # Unix time of that access, for people (tree_summary.py)
        self.hit_count = 0  # matches through this node; a parent has at least its children's count
        self.heap_seq = -1  # sequence number of this node's live entry in the eviction queue

    def is_evictable_leaf(self) -> bool:
        # `parent is None` on a non-root means the node was deleted.
        return bool(self.key) and self.lock_ref == 0 and not self.children and self.parent is not None

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"
