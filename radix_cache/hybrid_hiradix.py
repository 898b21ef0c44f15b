"""The hierarchical cache of hybrid models: state snapshots (radix_cache/hybrid.py) that move to the host tier with
their node's KV (radix_cache/hiradix.py) and come back on a hit.

A node may hold a snapshot on the device (`state_slot`, in the `StatePool`) and one on the host (`host_state_slot`,
in the `HostStatePool`), each only while the node's KV is on that tier:

- demotion: when the device evicts a node's KV to the host, its device snapshot is copied to a host slot (unless it
  has one already) and the device slot is freed; where the KV goes to disk or is dropped, the snapshot is dropped.
  The device snapshot LRU's victims (too few device snapshot slots) go to the host the same way where their node's
  KV has a host copy;
- host eviction: a node losing its host copy loses its host snapshot;
- matching: the longest cached prefix on any tier that ends on a node with a snapshot on either tier. When that node
  is on the host, `load_back` brings its path's KV and then its snapshot onto the device (a device snapshot slot,
  making room in the snapshot LRU); a device node whose snapshot is only on the host gets it back the same way.
  Where the device cannot take the whole path or the snapshot, the match ends at the deepest loaded node with a
  device snapshot: shorter, never wrong.

Snapshots on the disk tier are not kept (the scheduler refuses a disk tier for hybrid models; this class drops a
snapshot whose KV goes there). Host snapshot slots have their own LRU: when none is free, the least recently used
host snapshot not on a retained session's pinned path is dropped (its node keeps its KV). The class combines the two
caches through Python's method order (this, HybridRadixCache, HiRadixCache, RadixCache): HybridRadixCache's request
operations run over the tiered tree, and the overrides below keep snapshots beside the KV through the tier moves.

Accounting (`check_invariants`): both caches' rules, every device snapshot on a device node, every host snapshot on a
node with a host copy, and every slot of both state pools free or held by exactly one node.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.hinode import HiTreeNode
from radixserve.radix_cache.hiradix import HiRadixCache
from radixserve.radix_cache.host_pool import HostKVPool
from radixserve.radix_cache.hybrid import NO_SNAPSHOT, HybridRadixCache
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.state_pool import HostStatePool, StatePool


class HybridHiTreeNode(HiTreeNode):
    """A tiered node that may hold a state snapshot on the device and one on the host."""

    __slots__ = ("state_slot", "host_state_slot")

    def __init__(self, key: list, value: Any, parent: Optional[TreeNode], namespace: Optional[tuple]):
        super().__init__(key, value, parent, namespace)
        self.state_slot = NO_SNAPSHOT
        self.host_state_slot = NO_SNAPSHOT


class HybridHiRadixCache(HybridRadixCache, HiRadixCache):
    node_class = HybridHiTreeNode

    def __init__(self, req_to_token_pool: Any, allocator: Any, host_pool: HostKVPool, state_pool: StatePool,
                 host_state_pool: HostStatePool, page_size: int = 1, eviction_policy: str = "lru",
                 write_policy: str = "write_through", storage_dir: Optional[str] = None):
        self.state_pool = state_pool
        self.host_state_pool = host_state_pool
        # Nodes holding a device snapshot / a host snapshot, least recently used first.
        self._snapshots: collections.OrderedDict[HybridHiTreeNode, None] = collections.OrderedDict()
        self._host_snapshots: collections.OrderedDict[HybridHiTreeNode, None] = collections.OrderedDict()
        self.snapshots_backed_up = 0  # device -> host snapshot copies (demotions)
        self.snapshots_loaded = 0  # host -> device snapshot copies (hits on the host tier)
        HiRadixCache.__init__(self, req_to_token_pool, allocator, host_pool, page_size, eviction_policy,
                              write_policy, storage_dir)

    # ---- matching and loading back -----------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], namespace: tuple = ()) -> MatchResult:
        """The longest cached prefix of `token_ids` in `namespace`, on any tier, that ends on a state snapshot on
        either tier; its lower-tier part (`host_hit_length`) is for `load_back`. A match on the device whose snapshot
        is on the host only takes a device copy of it here (or is cut back where no device slot is free)."""
        match = super().match_prefix(token_ids, namespace)
        node = match.last_node
        if match.host_hit_length or not node.key:
            return match
        if node.state_slot == NO_SNAPSHOT:
            return self._with_device_snapshot(match)
        self._snapshots.move_to_end(node)
        return match

    def _resume_point(self, ns_root: TreeNode, token_ids: list[int], match: MatchResult) -> MatchResult:
        """The longest prefix of `match`, device part and lower-tier part, that ends on a snapshot on either tier."""
        node = match.last_host_node or match.last_node
        length = match.length + match.host_hit_length
        while node.key and node.state_slot == NO_SNAPSHOT and node.host_state_slot == NO_SNAPSHOT:
            length -= len(node.key)
            node = node.parent
        if length > match.length:  # it ends below the device part: load_back brings KV and snapshot back
            return MatchResult(match.indices, match.last_node, match.length, length - match.length, node)
        return MatchResult(match.indices[:length], node, length)

    def load_back(self, match: MatchResult) -> MatchResult:
        """`HiRadixCache.load_back`, then the snapshot at the end of the loaded part onto the device."""
        return self._with_device_snapshot(super().load_back(match))

    def _with_device_snapshot(self, match: MatchResult) -> MatchResult:
        """`match` (all on the device) cut back to its deepest node holding a device snapshot, after copying the
        host snapshot of its last node to the device where that node has no device one."""
        node, length = match.last_node, match.length
        if node.key and node.state_slot == NO_SNAPSHOT and node.host_state_slot != NO_SNAPSHOT:
            self._host_snapshots.move_to_end(node)
            # Finding a device slot may move another snapshot to the host, which may take this node's host slot
            # when it is the only one left: then there is nothing to load.
            if self._attach_snapshot(node) != NO_SNAPSHOT:
                if node.host_state_slot == NO_SNAPSHOT:
                    self._drop_snapshot(node)
                else:
                    self.host_state_pool.load(node.host_state_slot, node.state_slot)
                    self.snapshots_loaded += 1
        while node.key and node.state_slot == NO_SNAPSHOT:
            length -= len(node.key)
            node = node.parent
        if node.key:
            self._snapshots.move_to_end(node)
            if node.host_state_slot != NO_SNAPSHOT:
                self._host_snapshots.move_to_end(node)
        if length == match.length and not match.host_hit_length:
            return match
        return MatchResult(match.indices[:length], node, length)

    # ---- tier moves --------------------------------------------------------------------------------
    def _demote(self, node: HybridHiTreeNode) -> None:
        """`HiRadixCache._demote`, and the node's device snapshot goes to the host with its KV (or is dropped)."""
        super()._demote(node)
        if node.parent is None or node.state_slot == NO_SNAPSHOT:  # dropped (with its snapshot), or none
            return
        if node.host_value is not None and node.host_state_slot == NO_SNAPSHOT:
            self._backup_snapshot(node)
        self._drop_snapshot(node)

    def _evict_snapshot(self, node: HybridHiTreeNode) -> None:
        """The device snapshot LRU's victim keeps a host copy where its node's KV has one."""
        if node.host_value is not None and node.host_state_slot == NO_SNAPSHOT:
            self._backup_snapshot(node)
        self._drop_snapshot(node)

    def _backup_snapshot(self, node: HybridHiTreeNode) -> None:
        """Copy the node's device snapshot to a host slot, taking the least recently used host snapshot's slot when
        none is free (never one on a retained session's pinned path); nothing when every one is pinned."""
        slot = self.host_state_pool.alloc()
        if slot is None:
            victim = next((held for held in self._host_snapshots if not held.host_pins), None)
            if victim is None:
                return
            self._drop_host_snapshot(victim)
            slot = self.host_state_pool.alloc()
        self.host_state_pool.backup(node.state_slot, slot)
        node.host_state_slot = slot
        self._host_snapshots[node] = None
        self.snapshots_backed_up += 1

    def _evict_host(self, node: HybridHiTreeNode) -> None:
        self._drop_host_snapshot(node)  # its host copy goes: a backup dropped, moved to disk, or dropped
        super()._evict_host(node)

    def _drop_subtree(self, node: HybridHiTreeNode) -> None:
        stack = [node]
        while stack:
            doomed = stack.pop()
            stack.extend(doomed.children.values())
            self._drop_host_snapshot(doomed)
        super()._drop_subtree(node)

    def _drop_host_snapshot(self, node: HybridHiTreeNode) -> None:
        if node.host_state_slot == NO_SNAPSHOT:
            return
        self.host_state_pool.free(node.host_state_slot)
        node.host_state_slot = NO_SNAPSHOT
        del self._host_snapshots[node]

    # ---- tree maintenance ----------------------------------------------------------------------------
    def _delete_leaf(self, leaf: TreeNode) -> TreeNode:
        self._drop_host_snapshot(leaf)
        return super()._delete_leaf(leaf)

    def reset(self) -> None:
        super().reset()
        for node in list(self._host_snapshots):
            self._drop_host_snapshot(node)

    def check_invariants(self, held_slots: int = 0) -> None:
        """Both caches' invariants; device snapshots on device nodes, host snapshots on nodes with a host copy, and
        every host state slot free or held by exactly one node."""
        super().check_invariants(held_slots)
        nodes = self._nodes()
        if any(node.state_slot != NO_SNAPSHOT and node.value is None for node in nodes):
            raise AssertionError("hierarchical cache invariant violated: a device snapshot on a node off the device")
        on_host = {node for node in nodes if node.host_state_slot != NO_SNAPSHOT}
        if any(node.host_value is None for node in on_host):
            raise AssertionError("hierarchical cache invariant violated: a host snapshot on a node off the host")
        if on_host != set(self._host_snapshots):
            raise AssertionError("hierarchical cache invariant violated: the host snapshot LRU does not list exactly "
                                 "the nodes holding a host snapshot")
        try:
            self.host_state_pool.check_invariants(node.host_state_slot for node in on_host)
        except AssertionError as exc:
            raise AssertionError(f"hierarchical cache invariant violated: {exc}") from None
