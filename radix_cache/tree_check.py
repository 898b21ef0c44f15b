"""The invariants of the radix cache (tree.py), recomputed from scratch over the whole tree.

Kept apart from the cache because it reads every field of every node: tests call it after each operation, the
scheduler whenever it goes idle.
"""

from __future__ import annotations

from typing import Any

import torch


def check_tree(cache: Any, held_slots: int = 0) -> None:  # cache: a RadixCache
    """Raise AssertionError unless the tree and the slot accounting are consistent.

    `held_slots`: slots owned only by running requests (their own pages, in whole pages, not in the tree).
    Checks `allocator.size == free + evictable + protected + held`, lock counts, key/value shapes, links,
    the evictable/protected counters and the eviction queue against a full recomputation.
    """
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise AssertionError(f"radix cache invariant violated: {message}")

    page_size = cache.page_size
    root = cache.root
    require(root.parent is None and not root.key and root.lock_ref == 0, "malformed global root")
    evictable = protected = num_nodes = 0
    values, evictable_leaves = [], set()
    for namespace, ns_root in root.children.items():
        require(type(namespace) is tuple, f"namespace key {namespace!r} is not a tuple")
        require(ns_root.parent is root and ns_root.namespace == namespace and not ns_root.key,
                f"malformed root of namespace {namespace!r}")
        require(ns_root.lock_ref == 0, f"root of namespace {namespace!r} is locked")
        require(bool(ns_root.children), f"namespace {namespace!r} is empty but still in the tree")
        stack = [ns_root]
        while stack:
            parent = stack.pop()
            for first, node in parent.children.items():
                num_nodes += 1
                stack.append(node)
                key_len = len(node.key)
                require(node.parent is parent, f"{node!r} does not point back to its parent")
                require(node.namespace == namespace, f"{node!r} is tagged with another namespace")
                require(key_len > 0 and key_len % page_size == 0, f"key of {key_len} tokens is not whole pages")
                require(len(node.value) == key_len, f"{node!r} has {len(node.value)} slots for {key_len} tokens")
                expected = node.key[0] if page_size == 1 else tuple(node.key[:page_size])
                require(first == expected, f"{node!r} is filed under {first!r}, not its first page")
                require(node.lock_ref >= 0, f"{node!r} has a negative lock_ref")
                require(not parent.key or parent.lock_ref >= node.lock_ref,
                        f"{node!r} is locked more often than its parent")
                if node.lock_ref:
                    protected += key_len
                else:
                    evictable += key_len
                if node.is_evictable_leaf():
                    evictable_leaves.add(node)
                values.append(node.value)
    require(num_nodes == cache._num_nodes, f"node count {cache._num_nodes} != {num_nodes} found")
    require(evictable == cache._evictable, f"evictable_size {cache._evictable} != {evictable} recomputed")
    require(protected == cache._protected, f"protected_size {cache._protected} != {protected} recomputed")
    queued = cache._queue.live_nodes()
    require(len(queued) == len(set(queued)) and set(queued) == evictable_leaves,
            "eviction queue does not hold exactly the evictable leaves")
    if values:
        slots = torch.cat(values).cpu()
        require(int(slots.min()) >= page_size, "the tree holds a slot of the dummy page")
        require(len(torch.unique(slots)) == len(slots), "a KV slot is held twice in the tree")
        if page_size > 1:
            pages = slots.view(-1, page_size)
            require(bool((pages[:, 0] % page_size == 0).all()) and bool((pages.diff(dim=1) == 1).all()),
                    "a node value is not made of whole pages")
    free = cache.allocator.available_size()
    require(cache.allocator.size == free + evictable + protected + held_slots,
            f"slot accounting: size {cache.allocator.size} != free {free} + evictable {evictable} "
            f"+ protected {protected} + held {held_slots}")
