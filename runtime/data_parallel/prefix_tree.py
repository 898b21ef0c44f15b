"""An approximate picture of what each replica has cached: one radix tree per namespace, each node listing the
replicas that hold its prefix.

A router cannot see its replicas' radix trees, so it keeps a model of them: everything it sent to replica r is
assumed cached there (inserted at routing time), until r reports the prefix evicted (`forget`) or its cache
flushed (`drop_replica`). Ownership is prefix-closed: a replica that owns a node owns its ancestors. The tree's
own size is bounded: past `max_tokens`, least recently used leaves go first.

Keys are any sequences of hashable items: token ids in the data-parallel controller, characters in the Ray
Serve router (which routes before tokenization).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

Namespace = tuple


@dataclass(eq=False)
class _Node:
    key: list
    parent: Optional["_Node"]
    children: dict = field(default_factory=dict)
    owners: dict = field(default_factory=dict)  # replica -> logical time of its last use of this prefix
    last_use: int = 0


class ApproxPrefixTree:
    def __init__(self, max_tokens: int = 1 << 22) -> None:
        self.max_tokens = max_tokens
        self._roots: dict[Namespace, _Node] = {}
        self._clock = itertools.count(1)
        self.num_tokens = 0
        self.tokens_by_replica: dict[int, int] = {}  # tokens each replica is believed to hold

    # ---- queries ---------------------------------------------------------------------------------
    def match(self, namespace: Namespace, key: Sequence[Hashable]) -> dict[int, int]:
        """For each replica that holds a prefix of `key` in `namespace`, the length of its longest one."""
        node = self._roots.get(namespace)
        matched: dict[int, int] = {}
        depth = 0
        while node is not None and depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            shared = _common_length(child.key, key, depth)
            for replica in child.owners:
                matched[replica] = depth + shared
            if shared < len(child.key):
                break
            depth += shared
            node = child
        return matched

    # ---- updates ---------------------------------------------------------------------------------
    def insert(self, namespace: Namespace, key: Sequence[Hashable], replica: int) -> None:
        """Record that `replica` now holds `key` (and so every prefix of it) in `namespace`."""
        if not key:
            return
        now = next(self._clock)
        node = self._roots.setdefault(namespace, _Node([], None))
        depth = 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(list(key[depth:]), node)
                node.children[key[depth]] = child
                self.num_tokens += len(child.key)
            else:
                shared = _common_length(child.key, key, depth)
                if shared < len(child.key):
                    child = self._split(child, shared)
            if replica not in child.owners:
                self._own(replica, len(child.key))
            child.owners[replica] = now
            child.last_use = now
            depth += len(child.key)
            node = child
        if self.num_tokens > self.max_tokens:
            self._shrink(int(self.max_tokens * 0.9))

    def forget(self, namespace: Namespace, key: Sequence[Hashable], kept: int, replica: int) -> None:
        """`replica` evicted `key` past its first `kept` items: drop its ownership there (and below)."""
        node = self._roots.get(namespace)
        depth = 0
        while node is not None and depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                return
            if depth >= kept:
                self._disown(child, replica)
                return
            shared = _common_length(child.key, key, depth)
            if depth + shared <= kept:  # the evicted part does not start inside this node
                if shared < len(child.key):
                    return  # the path leaves the tree: nothing of it is recorded
                depth, node = depth + shared, child
                continue
            node, depth = self._split(child, kept - depth), kept

    def drop_replica(self, replica: int) -> None:
        """`replica`'s cache is empty now (flushed, or the replica restarted)."""
        for root in list(self._roots.values()):
            for child in list(root.children.values()):
                self._disown(child, replica)

    def replica_tokens(self, replica: int) -> int:
        return self.tokens_by_replica.get(replica, 0)

    # ---- internals -------------------------------------------------------------------------------
    def _split(self, node: _Node, length: int) -> _Node:
        """Cut `node` after `length` items; returns the new upper part (it keeps the owners)."""
        upper = _Node(node.key[:length], node.parent, owners=dict(node.owners), last_use=node.last_use)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[length:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _disown(self, node: _Node, replica: int) -> None:
        """Remove `replica` from `node`'s subtree; delete nodes left with no owner."""
        stack = [node]
        while stack:
            current = stack.pop()
            if current.owners.pop(replica, None) is not None:
                self._own(replica, -len(current.key))
            stack.extend(current.children.values())
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Delete the owner-less nodes of `node`'s subtree (their descendants are owner-less too)."""
        if node.owners:
            for child in list(node.children.values()):
                self._prune(child)
            return
        self._delete_subtree(node)

    def _delete_subtree(self, node: _Node) -> None:
        stack, removed = [node], 0
        while stack:
            current = stack.pop()
            removed += len(current.key)
            for replica in current.owners:
                self.tokens_by_replica[replica] -= len(current.key)
            stack.extend(current.children.values())
        self.num_tokens -= removed
        parent = node.parent
        del parent.children[node.key[0]]
        if parent.parent is None and not parent.children:
            for namespace, root in list(self._roots.items()):
                if root is parent:
                    del self._roots[namespace]

    def _shrink(self, target: int) -> None:
        """Delete least recently used leaves until the tree holds at most `target` items."""
        leaves = [node for node in self._nodes() if not node.children]
        leaves.sort(key=lambda node: node.last_use)
        for leaf in leaves:
            if self.num_tokens <= target:
                return
            parent = leaf.parent
            self._delete_subtree(leaf)
            if parent.parent is not None and not parent.children and parent.last_use <= leaf.last_use:
                leaves.append(parent)  # became a leaf as old as the one just removed

    def _nodes(self) -> list[_Node]:
        out, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _own(self, replica: int, delta: int) -> None:
        self.tokens_by_replica[replica] = self.tokens_by_replica.get(replica, 0) + delta


def _common_length(node_key: list, key: Sequence[Hashable], start: int) -> int:
    limit = min(len(node_key), len(key) - start)
    for i in range(limit):
        if node_key[i] != key[start + i]:
            return i
    return limit
