"""The tiers of the hierarchical radix cache (hiradix.py): where each node's KV lives, the moves of a node's KV
between the device, the host (`host_pool.py`) and disk (`disk_store.py`), and the accounting those moves keep exact.

Where a node's KV lives: `value` holds its device slots, `host_value` its host slots, `disk` its place on disk;
each is None when the node is not on that tier. A node is on the device (D), on the device with a host backup
(DH), on the host (H), or on disk (K). The rules (`hiradix_check.py` checks them):
- the device nodes are closed under parents, so a path from a namespace root is device nodes, then lower-tier ones;
- a node on disk is on no other tier, and every node is on at least one;
- a locked node is on the device (except for the nodes `load_back` is loading, while it runs).

Moves, each freeing what it leaves behind:
- device eviction (`evict`): the least recently used unlocked device leaf (no child on the device) is demoted. DH
  frees its device slots; D is copied to the host first (making room by host eviction), or to disk when the host has
  no room, and is dropped with its lower-tier subtree when no tier takes it.
- host eviction, least recently used first among host entries nothing below depends on: the backup of a DH node
  is dropped (the device copy stays); an H node with no child on the host moves to disk (or is dropped).
- disk eviction drops the least recently used childless disk node (only when the disk tier has a capacity).

Accounting: `evictable_size`/`protected_size` count device tokens only, so the scheduler's
`total == free + evictable + protected + held` holds unchanged; the host tier keeps `host size == host free +
host tokens`, and the disk tier counts its files' tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.radix_cache.disk_store import DiskKVStore
from radixserve.radix_cache.hinode import DiskQueue, HiTreeNode, HostQueue
from radixserve.radix_cache.host_pool import HostKVPool
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.stats import LowerTierInfo, TierCounters
from radixserve.radix_cache.tree import RadixCache

WRITE_POLICIES = ("write_through", "write_back")


class TieredRadixCache(RadixCache):
    """The base of `HiRadixCache`: the lower tiers' state and accounting, and the moves of a node's KV between the
    tiers (see the module docstring). When the tree's operations move KV is `HiRadixCache`'s (hiradix.py)."""

    node_class = HiTreeNode

    def __init__(self, req_to_token_pool: Any, allocator: Any, host_pool: HostKVPool, page_size: int = 1,
                 eviction_policy: str = "lru", write_policy: str = "write_through",
                 storage_dir: Optional[str] = None, disk_capacity: Optional[int] = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown hicache write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        if host_pool.page_size != page_size:
            raise ValueError(f"host pool page size {host_pool.page_size} differs from {page_size}")
        self.host = host_pool
        self.write_policy = write_policy
        self.disk = DiskKVStore(storage_dir, disk_capacity) if storage_dir is not None else None
        self.counters = TierCounters()
        self._host_queue = HostQueue("lru")
        self._disk_queue = DiskQueue("lru")
        self._fresh: list[HiTreeNode] = []  # nodes an insert created or adopted, for write-through
        # Device slots freed by `cache_unfinished_req` while the batch being built still writes them; a load-back
        # copies at once, perhaps while that batch runs, so they return to the allocator only through `evict`
        # (whose callers hand them to later batches) or `reset`. They count as evictable.
        self._quarantine: list[torch.Tensor] = []
        self._num_quarantined = 0
        super().__init__(req_to_token_pool, allocator, page_size, eviction_policy)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._host_tokens = 0  # tokens with a host copy
        self._disk_tokens = 0  # tokens of nodes on disk
        self._host_queue.clear()
        self._disk_queue.clear()

    def evictable_size(self) -> int:
        return self._evictable + self._num_quarantined

    def quarantined_slots(self) -> torch.Tensor:
        return torch.cat(self._quarantine) if self._quarantine else self._empty()

    def host_size(self) -> int:
        return self._host_tokens

    def disk_size(self) -> int:
        return self._disk_tokens

    def lower_tiers(self) -> LowerTierInfo:
        disk = self.disk
        return LowerTierInfo(
            write_policy=self.write_policy, host_total_tokens=self.host.size, host_used_tokens=self._host_tokens,
            host_free_tokens=self.host.available_size(), host_bytes_per_token=self.host.bytes_per_token,
            disk_used_tokens=disk.used if disk else 0, disk_capacity_tokens=disk.capacity if disk else None,
            counters=TierCounters(**vars(self.counters)),
        )

    # ---- quarantine: device slots held back until `evict` or `reset` -----------------------------------
    def _free_duplicates(self, slots: torch.Tensor) -> None:
        if len(slots):
            self._quarantine.append(slots.to(torch.int64, copy=True))
            self._num_quarantined += len(slots)

    def _release_quarantine(self) -> int:
        released = self._num_quarantined
        if self._quarantine:
            self.allocator.free(torch.cat(self._quarantine))
            self._quarantine, self._num_quarantined = [], 0
        return released

    # ---- moves between tiers ---------------------------------------------------------------------------
    def _evict_tree(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens:
            node = self._queue.pop()
            if node is None:
                break
            freed += len(node.key)
            self._evictable -= len(node.key)
            self._stats.of(node.namespace).evicted_tokens += len(node.key)
            self._demote(node)
        return freed

    def _demote(self, node: HiTreeNode) -> None:
        """Move an unlocked device leaf (already taken out of the device counters) off the device."""
        if node.host_value is None and not self._backup(node) and self.disk is not None:
            self._write_disk(node, self.host.read_device(node.value))
        parent = node.parent
        self.allocator.free(node.value)
        node.value = None
        if node.host_value is None and node.disk is None:
            self._drop_subtree(node)
        else:
            self._requeue(node)
        self._requeue(parent)

    def _evict_host(self, node: HiTreeNode) -> None:
        """Free the host copy of a host eviction candidate: drop a backup, or move an H node to disk (or drop it)."""
        if node.value is None and self.disk is not None:
            self._write_disk(node, self.host.read(node.host_value))
        parent = node.parent
        self.host.free(node.host_value)
        self._host_tokens -= len(node.key)
        node.host_value = None
        if node.value is None and node.disk is None:
            self.counters.dropped_tokens += len(node.key)
            self._drop_subtree(node)
        else:
            self._requeue(node)
        self._requeue(parent)

    def _backup(self, node: HiTreeNode) -> bool:
        """Copy a device node's KV to the host tier (evicting there); False when the host has no room."""
        host_slots = self._host_alloc(len(node.key))
        if host_slots is None:
            return False
        self.host.backup(node.value, host_slots)
        node.host_value = host_slots
        self._host_tokens += len(node.key)
        self.counters.backed_up_tokens += len(node.key)
        self._requeue(node)
        return True

    def _write_disk(self, node: HiTreeNode, data: torch.Tensor) -> bool:
        num_tokens = len(node.key)
        while not self.disk.has_room(num_tokens):
            victim = self._disk_queue.pop()
            if victim is None:
                return False
            self._drop_subtree(victim)
        ref = self.disk.put(data)
        if ref is None:
            return False
        node.disk = ref
        self._disk_tokens += num_tokens
        self.counters.written_to_disk_tokens += num_tokens
        return True

    def _free_disk(self, node: HiTreeNode) -> None:
        self.disk.release(node.disk)
        self._disk_tokens -= len(node.key)
        node.disk = None

    def _alloc_device(self, num_tokens: int) -> Optional[torch.Tensor]:
        available = self.allocator.available_size()
        if available < num_tokens:
            self._evict_tree(num_tokens - available)  # never the quarantine: this copy happens now
        return self.allocator.alloc(num_tokens)

    def _host_alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        if num_tokens > self.host.size:
            return None
        slots = self.host.alloc(num_tokens)
        while slots is None:
            victim = self._host_queue.pop()
            if victim is None:
                return None
            self._evict_host(victim)
            slots = self.host.alloc(num_tokens)
        return slots

    def _drop_subtree(self, node: HiTreeNode) -> None:
        """Remove `node` and its descendants, all off the device and unlocked, freeing their lower-tier copies."""
        parent, stack = node.parent, [node]
        while stack:
            doomed = stack.pop()
            assert doomed.value is None and doomed.lock_ref == 0, f"dropping {doomed!r}"
            stack.extend(doomed.children.values())
            if doomed.host_value is not None:
                self.host.free(doomed.host_value)
                self._host_tokens -= len(doomed.key)
                self.counters.dropped_tokens += len(doomed.key)
                doomed.host_value = None
            if doomed.disk is not None:
                self.counters.dropped_tokens += len(doomed.key)
                self._free_disk(doomed)
            if doomed is not node:
                doomed.parent = None
                self._num_nodes -= 1
        node.children = {}
        self._delete_leaf(node)
        self._requeue(parent)

    def _requeue(self, node: TreeNode) -> None:
        """(Re)queue `node` in every eviction queue it is a candidate of, with its current priority."""
        if node.parent is None or not node.key:
            return  # deleted, or a root
        if node.is_evictable_leaf():
            self._queue.push(node, self._num_nodes)
        if node.is_host_evictable():
            self._host_queue.push(node, self._num_nodes)
        if node.is_disk_evictable():
            self._disk_queue.push(node, self._num_nodes)
