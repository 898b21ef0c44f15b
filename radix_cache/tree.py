"""The radix cache: a radix tree of token ids whose values are the KV slots holding those tokens.

Structure. The global root has one child per namespace (a tuple of strings such as `(tenant_id, cache_salt)`;
`()` is the default), keyed by the tuple itself, so distinct namespaces never share a node or a match. Below a
namespace root each node holds a run of tokens (`key`, a list of ints) and their slots (`value`, an int64 tensor);
children are keyed by their first token (page_size 1) or by their first page as a tuple. Every non-root key is a
whole number of pages, so with `page_size > 1` only whole pages are ever matched or cached.

Ownership. The tree owns the slots of its nodes and frees them (on eviction and `reset`). A caller that inserts
keeps ownership of the slots of the tokens that were already present (the return value of `insert`) and of any
unaligned tail, and must free those itself; `cache_finished_req` and `cache_unfinished_req` do that on behalf of a
request (tree_requests.py).

Locking. A running request locks the last node of its prefix with `inc_lock_ref`, which raises `lock_ref` on
every node up to the namespace root; locked nodes are never evicted. Tokens in nodes with `lock_ref == 0` count
as evictable, the others as protected; both counters are kept exactly (see `check_invariants`).

Cost. `match_prefix` and `insert` walk one dict lookup and one prefix comparison per node on the path, so they
cost O(key length) regardless of how many sequences are cached; `evict` pops from a lazy heap of evictable leaves
(see `eviction.py`) instead of scanning the tree.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from radixserve.radix_cache.base import MatchResult
from radixserve.radix_cache.continuation import tree_continuation
from radixserve.radix_cache.eviction import EvictionQueue
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.node import TreeNode
from radixserve.radix_cache.stats import CacheStats
from radixserve.radix_cache.tree_check import check_tree
from radixserve.radix_cache.tree_requests import RequestCaching


class RadixCache(RequestCaching):
    """Prefix cache over paged KV slots. See the module docstring for ownership and locking rules."""

    node_class = TreeNode  # the hierarchical cache's nodes also record their lower tiers

    def __init__(self, req_to_token_pool: Any, allocator: Any, page_size: int = 1, eviction_policy: str = "lru"):
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} differs from the allocator's {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._queue = EvictionQueue(eviction_policy)
        self._stats = CacheStats()
        self._clock = 0  # logical time of the last access; strictly increasing, so LRU order is exact
        # Told of every evicted leaf (`evicted(leaf)`, before it leaves the tree) and of every flush (`reset()`):
        # a data-parallel replica's reporter (scheduler/replica_report.py).
        self.eviction_listener: Any = None
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = self.node_class([], self._empty(), None, None)
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # non-root nodes
        self._queue.clear()

    # ---- sizes and statistics ----------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by `evict`)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def tree_root(self) -> TreeNode:
        return self.root

    def stats(self) -> dict:
        """Per-namespace and overall counters (see `stats.CacheStats.as_dict`)."""
        return self._stats.as_dict()

    # ---- matching and insertion ----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], namespace: tuple = ()) -> MatchResult:
        """The longest cached prefix of `token_ids` in `namespace`, rounded down to whole pages.

        Splits a node when the match ends inside it, so that `last_node` ends exactly at the match. Marks the
        matched path as used (access time, hit count) and counts the query in the statistics. A cache whose prefixes
        resume only at some points (a state snapshot, window KV) cuts the match back in `_resume_point`.
        """
        stats = self._stats.of(namespace)
        stats.queried_tokens += len(token_ids)
        ns_root = self._namespace_root(namespace, create=False)
        if ns_root is None:
            return MatchResult(self._empty(), self.root, 0)
        result = self._resume_point(ns_root, token_ids, self._match(ns_root, token_ids, len(token_ids), touch=True))
        stats.matched_tokens += result.length + result.host_hit_length
        return result

    def _resume_point(self, ns_root: TreeNode, token_ids: list[int], match: MatchResult) -> MatchResult:
        """`match` cut back to the longest prefix a request can resume from: all of it here."""
        return match

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: tuple = ()) -> int:
        """Cache `token_ids` with KV `slots` (`slots[i]` holds token i); returns the tokens already present.

        Only the page-aligned part, `len(token_ids) // page_size * page_size` tokens, is inserted; the tail is
        ignored. The tree takes ownership of the slots of the newly inserted tokens. The caller keeps ownership of
        the other slots and frees those it does not otherwise hold: its copies of the already-present tokens
        (beyond a prefix it obtained from the tree) and the unaligned tail.
        """
        num_aligned = len(token_ids) - len(token_ids) % self.page_size
        if len(slots) < num_aligned:
            raise ValueError(f"{len(slots)} slots for {num_aligned} tokens")
        if num_aligned == 0:
            return 0
        ns_root = self._namespace_root(namespace, create=True)
        return self._insert(ns_root, token_ids, num_aligned, slots)

    def _match(self, ns_root: TreeNode, key: list, end: int, touch: bool) -> MatchResult:
        page_size = self.page_size
        end -= end % page_size
        if touch:
            self._clock += 1
            wall = time.time()
        now = self._clock
        node, pos, values = ns_root, 0, []
        while pos < end:
            child = node.children.get(key[pos] if page_size == 1 else tuple(key[pos:pos + page_size]))
            if child is None:
                break
            matched = common_prefix_length(child.key, key, pos, end)
            matched -= matched % page_size
            if matched < len(child.key):
                child = self._split(child, matched)
                split = True
            else:
                split = False
            if touch:
                child.last_access = now
                child.last_access_time = wall
                child.hit_count += 1
            values.append(child.value)
            pos += matched
            node = child
            if split:
                break  # the query diverges inside the old node
        if touch and node.is_evictable_leaf():
            self._queue.push(node, self._num_nodes)
        indices = torch.cat(values) if len(values) > 1 else (values[0] if values else self._empty())
        return MatchResult(indices, node, pos)

    def continuation(self, token_ids: list[int], namespace: tuple, max_tokens: int) -> list[int]:
        ns_root = self._namespace_root(namespace, create=False)
        return [] if ns_root is None or max_tokens <= 0 else tree_continuation(ns_root, token_ids, max_tokens)

    def _insert(self, ns_root: TreeNode, key: list, end: int, slots: torch.Tensor) -> int:
        """Insert `key[:end]` (`end` page-aligned, > 0); ends on a node boundary; returns tokens already present."""
        self._clock += 1
        now, wall = self._clock, time.time()
        page_size = self.page_size
        stats = self._stats.of(ns_root.namespace)
        node, pos = ns_root, 0
        while pos < end:
            first = key[pos] if page_size == 1 else tuple(key[pos:pos + page_size])
            child = node.children.get(first)
            if child is None:
                # Copy: the caller's tensor (often a req_to_token row) is rewritten later.
                leaf = self.node_class(key[pos:end], slots[pos:end].to(torch.int64, copy=True), node, ns_root.namespace)
                leaf.last_access, leaf.last_access_time = now, wall
                node.children[first] = leaf
                self._num_nodes += 1
                self._evictable += end - pos
                stats.inserted_tokens += end - pos
                self._queue.push(leaf, self._num_nodes)
                return pos
            matched = common_prefix_length(child.key, key, pos, end)
            matched -= matched % page_size
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access, child.last_access_time = now, wall
            pos += matched
            node = child
        if node.is_evictable_leaf():
            self._queue.push(node, self._num_nodes)
        return end

    def _split(self, node: TreeNode, length: int) -> TreeNode:
        """Cut `node` after `length` tokens; returns the new upper part. `node` keeps the lower part, so a
        request holding `node` as its last_node still ends at the same place."""
        parent = node.parent
        upper = self.node_class(node.key[:length], node.value[:length], parent, node.namespace)
        # Locks cover whole paths, so the upper part carries the same locks as the node it was cut from.
        upper.lock_ref = node.lock_ref
        upper.last_access, upper.last_access_time = node.last_access, node.last_access_time
        upper.hit_count = node.hit_count
        page_size = self.page_size
        first = node.key[0] if page_size == 1 else tuple(node.key[:page_size])
        node.key = node.key[length:]
        node.value = node.value[length:]
        node.parent = upper
        upper.children[node.key[0] if page_size == 1 else tuple(node.key[:page_size])] = node
        parent.children[first] = upper
        self._num_nodes += 1
        return upper

    # ---- locking -------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from `node` up to its namespace root; returns the change of `evictable_size()`.

        Locking a root (nothing matched) is a no-op.
        """
        delta = 0
        while node.key:
            if node.lock_ref == 0 and node.value is not None:  # a node whose KV left the device counts nowhere
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of `evictable_size()`."""
        delta = 0
        while node.key:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref below zero on {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
                if not node.children:
                    self._queue.push(node, self._num_nodes)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def lock_prefix(self, token_ids: list[int], namespace: tuple = ()) -> Optional[tuple[TreeNode, int]]:
        """Lock the cached prefix of `token_ids` in `namespace` as a running request's prefix is locked, without
        counting a query or a use; returns (its last node, its length), or None when none of it is cached. The
        holder unlocks it with `dec_lock_ref(node)` (retained sessions, retention.py)."""
        ns_root = self._namespace_root(namespace, create=False)
        if ns_root is None:
            return None
        match = self._match(ns_root, token_ids, len(token_ids), touch=False)
        if match.length == 0:
            return None
        self.inc_lock_ref(match.last_node)
        return match.last_node, match.length

    # ---- eviction and flush --------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens from unlocked leaves, lowest priority first (LRU or LFU).

        Returns the tokens freed: at least `num_tokens`, or fewer when nothing evictable is left. A parent whose
        last child goes becomes a leaf and may be evicted in the same call.
        """
        freed, values = 0, []
        while freed < num_tokens:
            leaf = self._queue.pop()
            if leaf is None:
                break
            values.append(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            self._stats.of(leaf.namespace).evicted_tokens += len(leaf.key)
            if self.eviction_listener is not None:
                self.eviction_listener.evicted(leaf)
            parent = self._delete_leaf(leaf)
            if parent.is_evictable_leaf():
                self._queue.push(parent, self._num_nodes)
        if values:
            # One free call: the allocator's cost per call, not per leaf.
            self.allocator.free(torch.cat(values) if len(values) > 1 else values[0])
        return freed

    def evict_namespaces(self, selected: Callable[[tuple], bool]) -> int:
        """Free the unlocked nodes of the namespaces `selected` picks, deepest first; nodes locked by running
        requests stay (they go through the usual eviction once released). Returns the tokens freed."""
        freed, values = 0, []
        for namespace, ns_root in list(self.root.children.items()):
            if not selected(namespace):
                continue
            preorder, stack = [], [ns_root]
            while stack:
                node = stack.pop()
                preorder.append(node)
                stack.extend(node.children.values())
            for node in reversed(preorder):  # every node after all of its descendants
                if node is ns_root or not node.is_evictable_leaf():
                    continue
                values.append(node.value)
                freed += len(node.key)
                self._evictable -= len(node.key)
                self._stats.of(namespace).evicted_tokens += len(node.key)
                self._delete_leaf(node)
        if values:
            self.allocator.free(torch.cat(values))
        return freed

    def reset(self) -> None:
        """Drop every cached prefix and free all its slots. Raises RuntimeError while any node is locked."""
        if self._protected:
            raise RuntimeError(f"cannot flush the radix cache: {self._protected} tokens are locked by requests")
        values = [node.value for node in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()
        if self.eviction_listener is not None:
            self.eviction_listener.reset()

    # ---- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, held_slots: int = 0) -> None:
        """The tree and the slot accounting; see tree_check.py."""
        check_tree(self, held_slots)

    # ---- helpers -------------------------------------------------------------------------------------
    def _namespace_root(self, namespace: tuple, create: bool) -> Optional[TreeNode]:
        if type(namespace) is not tuple:
            raise TypeError(f"a cache namespace is a tuple, got {type(namespace).__name__}")
        ns_root = self.root.children.get(namespace)
        if ns_root is None and create:
            ns_root = self.root.children[namespace] = self.node_class([], self._empty(), self.root, namespace)
        return ns_root

    def _delete_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        page_size = self.page_size
        del parent.children[leaf.key[0] if page_size == 1 else tuple(leaf.key[:page_size])]
        leaf.parent = None
        self._num_nodes -= 1
        if not parent.children and parent.parent is self.root:
            del self.root.children[parent.namespace]  # an emptied namespace leaves no trace in the tree
        return parent

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node (depth-first)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            children = node.children.values()
            stack.extend(children)
            if node.key:
                out.append(node)
        return out

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
