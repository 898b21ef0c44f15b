"""Nodes of the hierarchical radix cache (hiradix.py): a tree node that also records its host and disk copies,
and the eviction queues of the host and disk tiers over such nodes (the lazy heaps of eviction.py, with their
own candidate tests and sequence fields).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.radix_cache.disk_store import DiskRef
from radixserve.radix_cache.eviction import EvictionQueue
from radixserve.radix_cache.node import TreeNode


class HiTreeNode(TreeNode):
    __slots__ = ("host_value", "disk", "host_seq", "disk_seq", "host_pins")

    def __init__(self, key: list, value: Optional[torch.Tensor], parent: Optional[TreeNode], namespace: Optional[tuple]):
        super().__init__(key, value, parent, namespace)
        self.host_value: Optional[torch.Tensor] = None  # int64 host slots
        self.disk: Optional[DiskRef] = None
        self.host_seq = -1  # live entries in the host and disk eviction queues
        self.disk_seq = -1
        self.host_pins = 0  # retained sessions keeping this node on the host (hiradix.py, retain_prefix)

    def is_evictable_leaf(self) -> bool:
        """A device eviction candidate: on the device, unlocked, no child on the device."""
        return (self.value is not None and bool(self.key) and self.lock_ref == 0 and self.parent is not None
                and not any(child.value is not None for child in self.children.values()))

    def is_host_evictable(self) -> bool:
        """A host eviction candidate: an unlocked, unpinned backup, or such an H node with no child on the host."""
        if self.host_value is None or self.lock_ref or self.host_pins or self.parent is None:
            return False
        return self.value is not None or all(child.host_value is None for child in self.children.values())

    def is_disk_evictable(self) -> bool:
        return self.disk is not None and self.lock_ref == 0 and self.parent is not None and not self.children

    def __repr__(self) -> str:
        tiers = "".join(t for t, v in (("D", self.value), ("H", self.host_value), ("K", self.disk)) if v is not None)
        return (f"HiTreeNode(len={len(self.key)}, tiers={tiers}, lock_ref={self.lock_ref}, host_pins={self.host_pins}, "
                f"children={len(self.children)})")


class HostQueue(EvictionQueue):
    """Host eviction candidates, least recently used first."""

    @staticmethod
    def _is_live(entry: tuple) -> bool:
        node = entry[-1]
        return entry[-2] == node.host_seq and node.is_host_evictable()

    @staticmethod
    def _stamp(node: Any, seq: int) -> None:
        node.host_seq = seq


class DiskQueue(EvictionQueue):
    """Disk eviction candidates, least recently used first."""

    @staticmethod
    def _is_live(entry: tuple) -> bool:
        node = entry[-1]
        return entry[-2] == node.disk_seq and node.is_disk_evictable()

    @staticmethod
    def _stamp(node: Any, seq: int) -> None:
        node.disk_seq = seq
