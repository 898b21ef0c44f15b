"""The invariants of the hierarchical radix cache (hiradix.py), recomputed from scratch over the whole tree.

Kept apart from the cache because it reads every field of every node and every tier: tests call it after each
operation, the scheduler whenever it goes idle.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"hierarchical cache invariant violated: {message}")


def _check_slots(values: list, page_size: int, tier: str) -> None:
    """Slots of one tier: none on the dummy page, none held twice, every node value made of whole pages."""
    if not values:
        return
    slots = torch.cat([v.cpu() for v in values])
    _require(int(slots.min()) >= page_size, f"the {tier} tier holds a slot of the dummy page")
    _require(len(torch.unique(slots)) == len(slots), f"a {tier} slot is held twice")
    if page_size > 1:
        pages = slots.view(-1, page_size)
        _require(bool((pages[:, 0] % page_size == 0).all()) and bool((pages.diff(dim=1) == 1).all()),
                 f"a {tier} node value is not made of whole pages")


def check_hiradix(cache: Any, held_slots: int = 0) -> None:  # cache: a HiRadixCache
    """Raise AssertionError unless the tree, the three tiers and the eviction queues are consistent.

    Device: `allocator.size == free + evictable + protected + held_slots`, counting device tokens only (the
    quarantined slots among the evictable ones). Host:
    `host.size == host free + tokens with a host copy`. Disk: the tokens of nodes on disk, and each file's
    reference count. Per node: at least one tier; disk excludes the other tiers; device nodes closed under
    parents; locked nodes on the device; pinned nodes (retained sessions) on the host; lock and pin counts never above
    the parent's. Queues: each holds exactly its
    tier's candidates.
    """
    page_size, root = cache.page_size, cache.root
    _require(root.parent is None and not root.key and root.lock_ref == 0, "malformed global root")
    evictable = protected = host_tokens = disk_tokens = num_nodes = 0
    device_values, host_values, disk_refs = [], [], Counter()
    candidates = {"device": set(), "host": set(), "disk": set()}
    for namespace, ns_root in root.children.items():
        _require(type(namespace) is tuple, f"namespace key {namespace!r} is not a tuple")
        _require(ns_root.parent is root and ns_root.namespace == namespace and not ns_root.key,
                 f"malformed root of namespace {namespace!r}")
        _require(ns_root.lock_ref == 0 and bool(ns_root.children), f"namespace {namespace!r} is locked or empty")
        stack = [ns_root]
        while stack:
            parent = stack.pop()
            for first, node in parent.children.items():
                num_nodes += 1
                stack.append(node)
                key_len = len(node.key)
                on_device = node.value is not None
                _require(node.parent is parent and node.namespace == namespace, f"{node!r} is linked wrongly")
                _require(key_len > 0 and key_len % page_size == 0, f"key of {key_len} tokens is not whole pages")
                expected = node.key[0] if page_size == 1 else tuple(node.key[:page_size])
                _require(first == expected, f"{node!r} is filed under {first!r}, not its first page")
                _require(node.lock_ref >= 0, f"{node!r} has a negative lock_ref")
                _require(not parent.key or parent.lock_ref >= node.lock_ref,
                         f"{node!r} is locked more often than its parent")
                _require(on_device or node.host_value is not None or node.disk is not None, f"{node!r} is on no tier")
                _require(node.disk is None or (not on_device and node.host_value is None),
                         f"{node!r} is on disk and on another tier")
                _require(not on_device or not parent.key or parent.value is not None,
                         f"{node!r} is on the device below a parent that is not")
                _require(on_device or node.lock_ref == 0, f"{node!r} is locked but not on the device")
                _require(node.host_pins == 0 or node.host_value is not None, f"{node!r} is pinned but not on the host")
                _require(not parent.key or parent.host_pins >= node.host_pins,
                         f"{node!r} is pinned more often than its parent")
                if on_device:
                    _require(len(node.value) == key_len, f"{node!r} has {len(node.value)} device slots")
                    device_values.append(node.value)
                    if node.lock_ref:
                        protected += key_len
                    else:
                        evictable += key_len
                if node.host_value is not None:
                    _require(len(node.host_value) == key_len, f"{node!r} has {len(node.host_value)} host slots")
                    host_values.append(node.host_value)
                    host_tokens += key_len
                if node.disk is not None:
                    disk_refs[node.disk.file] += 1
                    disk_tokens += key_len
                for tier, is_candidate in (("device", node.is_evictable_leaf), ("host", node.is_host_evictable),
                                           ("disk", node.is_disk_evictable)):
                    if is_candidate():
                        candidates[tier].add(node)
    _require(num_nodes == cache._num_nodes, f"node count {cache._num_nodes} != {num_nodes} found")
    quarantined = cache.quarantined_slots()
    evictable += len(quarantined)
    _require(evictable == cache.evictable_size(), f"evictable_size {cache.evictable_size()} != {evictable}")
    _require(protected == cache.protected_size(), f"protected_size {cache.protected_size()} != {protected}")
    _require(host_tokens == cache.host_size(), f"host tokens {cache.host_size()} != {host_tokens} recomputed")
    _require(disk_tokens == cache.disk_size(), f"disk tokens {cache.disk_size()} != {disk_tokens} recomputed")
    for tier, queue in (("device", cache._queue), ("host", cache._host_queue), ("disk", cache._disk_queue)):
        queued = queue.live_nodes()
        _require(len(queued) == len(set(queued)) and set(queued) == candidates[tier],
                 f"the {tier} eviction queue does not hold exactly the {tier} candidates")
    _check_slots(device_values + ([quarantined] if len(quarantined) else []), page_size, "device")
    _check_slots(host_values, page_size, "host")
    free = cache.allocator.available_size()
    _require(cache.allocator.size == free + evictable + protected + held_slots,
             f"device slots: size {cache.allocator.size} != free {free} + evictable {evictable} "
             f"+ protected {protected} + held {held_slots}")
    host_free = cache.host.available_size()
    _require(cache.host.size == host_free + host_tokens,
             f"host slots: size {cache.host.size} != free {host_free} + used {host_tokens}")
    if cache.disk is None:
        _require(not disk_refs, "nodes on disk without a disk tier")
    else:
        _require(dict(disk_refs) == cache.disk.references(), "disk file references do not match the nodes")
        _require(cache.disk.capacity is None or cache.disk.used <= cache.disk.capacity, "disk tier over capacity")
