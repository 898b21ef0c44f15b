"""The hierarchical radix cache (`--enable-hierarchical-cache`): the radix tree over the device KV pool, with a host
tier under it (`host_pool.py`) and optionally a disk tier under that (`disk_store.py`). SGLang's HiCache, in this
runtime's terms.

This file holds when the tree's operations move KV between the tiers; where a node's KV lives, the moves themselves
(demotion, host and disk eviction) and the tiers' accounting are in hiradix_tiers.py.
- `evict` (device) hands back the quarantined slots first, then demotes unlocked device leaves.
- `write_through` backs a node up to the host as soon as its KV is final and unlocked: when inserted unlocked (a
  finished request), or when its lock count drops to zero. `write_back` copies only on demotion.
- `load_back(match)` gives the lower-tier nodes at the end of a match device slots and copies their KV in before
  the request's extend is planned; the extend then reads them like any cached prefix.
- an insert over lower-tier nodes (a request computed tokens whose KV had left the device) adopts the request's
  device slots into them: H becomes DH, K becomes D.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.hinode import HiTreeNode
from radixserve.radix_cache.hiradix_check import check_hiradix
from radixserve.radix_cache.hiradix_tiers import TieredRadixCache
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.node import TreeNode


class HiRadixCache(TieredRadixCache):
    """A RadixCache whose evictions demote to lower tiers; see the module docstring."""

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

    # ---- eviction and flush ----------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots: the quarantined ones, then by demoting unlocked device leaves
        (least recently used first); returns the device tokens freed."""
        freed = self._release_quarantine()
        return freed + self._evict_tree(num_tokens - freed)

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

    # ---- write policy: when a node is backed up to the host -------------------------------------------
    def _write_through(self, nodes) -> None:
        if self.write_policy != "write_through":
            return
        for node in nodes:
            if node.parent is not None and node.value is not None and node.host_value is None and not node.lock_ref:
                self._backup(node)

    # ---- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, held_slots: int = 0) -> None:
        """The tree, all three tiers' accounting and the eviction queues; see hiradix_check.py."""
        check_hiradix(self, held_slots)
