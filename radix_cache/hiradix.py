"""The hierarchical radix cache (`--enable-hierarchical-cache`): the radix tree over the device KV pool, with a host
tier under it (`host_pool.py`) and optionally a disk tier under that (`disk_store.py`). SGLang's HiCache, in this
runtime's terms.

Where a node's KV lives: `value` holds its device slots, `host_value` its host slots, `disk` its place on disk;
each is None when the node is not on that tier. A node is on the device (D), on the device with a host backup
(DH), on the host (H), or on disk (K). The rules (`hiradix_check.py` checks them):
- the device nodes are closed under parents, so a path from a namespace root is device nodes, then lower-tier ones;
- a node on disk is on no other tier, and every node is on at least one;
- a locked node is on the device (except for the nodes `load_back` is loading, while it runs).

Moves, each freeing what it leaves behind:
- `evict` (device): the least recently used unlocked device leaf (no child on the device) is demoted. DH frees its
  device slots; D is copied to the host first (making room by host eviction), or to disk when the host has no
  room, and is dropped with its lower-tier subtree when no tier takes it.
- host eviction, least recently used first among host entries nothing below depends on: the backup of a DH node
  is dropped (the device copy stays); an H node with no child on the host moves to disk (or is dropped).
- disk eviction drops the least recently used childless disk node (only when the disk tier has a capacity).
- `write_through` backs a node up to the host as soon as its KV is final and unlocked: when inserted unlocked (a
  finished request), or when its lock count drops to zero. `write_back` copies only on demotion.
- `load_back(match)` gives the lower-tier nodes at the end of a match device slots and copies their KV in before
  the request's extend is planned; the extend then reads them like any cached prefix.
- an insert over lower-tier nodes (a request computed tokens whose KV had left the device) adopts the request's
  device slots into them: H becomes DH, K becomes D.

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
from radixserve.radix_cache.stats import LowerTierInfo, TierCounters
from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.hiradix_check import check_hiradix
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.tree import RadixCache, TreeNode

WRITE_POLICIES = ("write_through", "write_back")


class HiRadixCache(RadixCache):
    """A RadixCache whose evictions demote to lower tiers; see the module docstring."""

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

    # ---- matching, loading back, inserting ---------------------------------------------------------------
    def _match(self, ns_root: TreeNode, key: list, end: int, touch: bool) -> MatchResult:
        """As `RadixCache._match`; the match continues through lower-tier nodes (`host_hit_length`)."""
        page_size = self.page_size
        end -= end % page_size
        if touch:
            self._clock += 1
        now = self._clock
        node, pos, values, path = ns_root, 0, [], []
        device_node, device_len = ns_root, 0
        while pos < end:
            child = node.children.get(key[pos] if page_size == 1 else tuple(key[pos:pos + page_size]))
            if child is None:
                break
            matched = common_prefix_length(child.key, key, pos, end)
            matched -= matched % page_size
            split = matched < len(child.key)
            if split:
                child = self._split(child, matched)
            if touch:
                child.last_access = now
                child.hit_count += 1
                path.append(child)
            pos += matched
            if child.value is not None:  # device nodes come first on every path
                values.append(child.value)
                device_node, device_len = child, pos
            node = child
            if split:
                break
        for touched in path:  # new priorities in every queue the node is in
            self._requeue(touched)
        indices = torch.cat(values) if len(values) > 1 else (values[0] if values else self._empty())
        return MatchResult(indices, device_node, device_len, pos - device_len, node if pos > device_len else None)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the lower-tier end of `match` onto the device; returns the match extended by what was loaded.

        Locks the whole matched path while device slots are found (evicting, never the path itself), so the load
        may take fewer nodes than matched when the device is short. The copies are queued before the request's
        extend is planned (on CUDA on a copy stream the next batch waits for; see host_pool.py).
        """
        last = match.last_host_node
        if not match.host_hit_length or last is None or last.parent is None:
            return match
        path, node = [], last
        while node.value is None:
            path.append(node)
            node = node.parent
        if node is not match.last_node:
            return match  # the tree changed since the match
        path.reverse()
        self.inc_lock_ref(last)
        slots = None
        while path and (slots := self._alloc_device(sum(len(n.key) for n in path))) is None:
            path.pop()
        offset = 0
        for node in path:
            num_tokens = len(node.key)
            device_slots = slots[offset:offset + num_tokens]
            offset += num_tokens
            if node.host_value is not None:
                self.host.load(node.host_value, device_slots)
                self.counters.loaded_from_host_tokens += num_tokens
            else:
                self.host.load_data(self.disk.get(node.disk, num_tokens), device_slots)
                self._free_disk(node)
                self.counters.loaded_from_disk_tokens += num_tokens
            node.value = device_slots
            self._protected += num_tokens  # locked above
        self.dec_lock_ref(last)
        if not path:
            return match
        remaining = match.host_hit_length - offset
        return MatchResult(torch.cat([match.indices, slots]), path[-1], match.length + offset, remaining,
                           last if remaining else None)

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: tuple = ()) -> int:
        """As `RadixCache.insert`; tokens found in lower tiers count as absent: the tree takes `slots` for them."""
        self._fresh = []
        present = super().insert(token_ids, slots, namespace)
        self._write_through(self._fresh)
        return present

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        self._fresh = []
        super().cache_finished_req(req, token_ids)
        self._write_through(self._fresh)

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        # The KV of the inserted tokens is not computed yet; it is backed up once the request lets go of it.
        self._fresh = []
        super().cache_unfinished_req(req, token_ids)
        self._fresh = []

    def _insert(self, ns_root: TreeNode, key: list, end: int, slots: torch.Tensor) -> int:
        self._clock += 1
        now = self._clock
        page_size = self.page_size
        stats = self._stats.of(ns_root.namespace)
        node, pos, present = ns_root, 0, None
        while pos < end:
            first = key[pos] if page_size == 1 else tuple(key[pos:pos + page_size])
            child = node.children.get(first)
            if child is None:
                leaf = self.node_class(key[pos:end], slots[pos:end].to(torch.int64, copy=True), node, ns_root.namespace)
                leaf.last_access = now
                node.children[first] = leaf
                self._num_nodes += 1
                self._evictable += end - pos
                stats.inserted_tokens += end - pos
                self._fresh.append(leaf)
                self._requeue(leaf)
                return pos if present is None else present
            matched = common_prefix_length(child.key, key, pos, end)
            matched -= matched % page_size
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            if child.value is None:
                present = pos if present is None else present
                self._adopt(child, slots[pos:pos + matched])
            pos += matched
            node = child
        self._requeue(node)
        return end if present is None else present

    def _adopt(self, node: HiTreeNode, slots: torch.Tensor) -> None:
        """Give a lower-tier node the device slots of a request that computed its tokens again."""
        assert node.lock_ref == 0, f"{node!r} is locked but not on the device"
        node.value = slots.to(torch.int64, copy=True)
        self._evictable += len(node.key)
        if node.disk is not None:
            self._free_disk(node)
        self._fresh.append(node)
        self._requeue(node)

    def _split(self, node: TreeNode, length: int) -> TreeNode:
        parent = node.parent
        upper = self.node_class(node.key[:length], None if node.value is None else node.value[:length], parent,
                                node.namespace)
        upper.lock_ref, upper.last_access, upper.hit_count = node.lock_ref, node.last_access, node.hit_count
        upper.host_pins = node.host_pins
        if node.value is not None:
            node.value = node.value[length:]
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:length], node.host_value[length:]
        if node.disk is not None:
            upper.disk, node.disk = self.disk.split(node.disk, length)
        page_size = self.page_size
        first = node.key[0] if page_size == 1 else tuple(node.key[:page_size])
        node.key = node.key[length:]
        node.parent = upper
        upper.children[node.key[0] if page_size == 1 else tuple(node.key[:page_size])] = node
        parent.children[first] = upper
        self._num_nodes += 1
        self._requeue(upper)
        return upper

    # ---- locking: only device tokens count as protected or evictable ---------------------------------------
    def dec_lock_ref(self, node: TreeNode) -> int:
        delta, unlocked = 0, []
        while node.key:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref below zero on {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.value is not None:
                    delta += len(node.key)
                unlocked.append(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        for node in unlocked:
            self._requeue(node)
        self._write_through(reversed(unlocked))
        return delta

    # ---- retained sessions: kept on the host tier ---------------------------------------------------------------
    retains_on_device = False

    def retain_prefix(self, token_ids: list[int], namespace: tuple = ()) -> Optional[tuple[TreeNode, int]]:
        """Pin the cached prefix of `token_ids` (on any tier) on the host for a retained session: every node of its
        path gets a host copy now (host eviction making room among unpinned entries) and host eviction passes it by
        until `release_prefix`. The device demotes the path as any unlocked prefix, so a session holds no device
        room while it waits; its next turn loads the prefix back. None when nothing is cached or the host cannot
        hold the whole path."""
        ns_root = self._namespace_root(namespace, create=False)
        if ns_root is None:
            return None
        match = self._match(ns_root, token_ids, len(token_ids), touch=False)
        last = match.last_host_node or match.last_node
        if last is ns_root or not last.key:
            return None
        path, node = [], last
        while node.key:
            node.host_pins += 1  # first, so that the backups below never evict a node of the path
            path.append(node)
            node = node.parent
        for node in path:
            if node.host_value is None and (node.value is None or not self._backup(node)):
                self.release_prefix(last)
                return None
        for node in path:
            self._requeue(node)
        return last, match.length + match.host_hit_length

    def retention_budget(self, device_tokens: int) -> int:
        """Three quarters of the host tier: the rest keeps room for the backups of unretained prefixes."""
        return self.host.size * 3 // 4

    def release_prefix(self, handle: TreeNode) -> None:
        node = handle
        while node.key:
            if node.host_pins <= 0:
                raise AssertionError(f"release_prefix below zero on {node!r}")
            node.host_pins -= 1
            self._requeue(node)
            node = node.parent

    # ---- eviction and demotion -------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots: the quarantined ones, then by demoting unlocked device leaves
        (least recently used first); returns the device tokens freed."""
        freed = self._release_quarantine()
        return freed + self._evict_tree(num_tokens - freed)

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

    def reset(self) -> None:
        """Drop every cached prefix in every tier. Raises RuntimeError while any node is locked."""
        if self._protected:
            raise RuntimeError(f"cannot flush the radix cache: {self._protected} tokens are locked by requests")
        self._release_quarantine()
        nodes = self._nodes()
        device = [node.value for node in nodes if node.value is not None]
        host = [node.host_value for node in nodes if node.host_value is not None]
        if device:
            self.allocator.free(torch.cat(device))
        if host:
            self.host.free(torch.cat(host))
        for node in nodes:
            if node.disk is not None:
                self.disk.release(node.disk)
        self._init_tree()

    def close(self) -> None:
        """Remove the disk tier's folder (the process exit does it too)."""
        if self.disk is not None:
            self.disk.close()

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

    def _write_through(self, nodes) -> None:
        if self.write_policy != "write_through":
            return
        for node in nodes:
            if node.parent is not None and node.value is not None and node.host_value is None and not node.lock_ref:
                self._backup(node)

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

    # ---- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, held_slots: int = 0) -> None:
        """The tree, all three tiers' accounting and the eviction queues; see hiradix_check.py."""
        check_hiradix(self, held_slots)
