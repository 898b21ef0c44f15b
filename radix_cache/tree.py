"""The radix cache: a radix tree of token ids whose values are the KV slots holding those tokens.

Structure. The global root has one child per namespace (a tuple of strings such as `(tenant_id, cache_salt)`;
`()` is the default), keyed by the tuple itself, so distinct namespaces never share a node or a match. Below a
namespace root each node holds a run of tokens (`key`, a list of ints) and their slots (`value`, an int64 tensor);
children are keyed by their first token (page_size 1) or by their first page as a tuple. Every non-root key is a
whole number of pages, so with `page_size > 1` only whole pages are ever matched or cached.

Ownership. The tree owns the slots of its nodes and frees them (on eviction and `reset`). A caller that inserts
keeps ownership of the slots of the tokens that were already present (the return value of `insert`) and of any
unaligned tail, and must free those itself; `cache_finished_req` and `cache_unfinished_req` do that on behalf of a
request.

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

from radixserve.radix_cache.base import MatchResult, PrefixCache
from radixserve.radix_cache.continuation import tree_continuation
from radixserve.radix_cache.eviction import EvictionQueue
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.stats import CacheStats


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


class RadixCache(PrefixCache):
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

    # ---- request-level operations --------------------------------------------------------------------
    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """Hand a finished (or aborted, or retracted) request's KV to the tree and release its lock.

        `token_ids` are the tokens whose KV is in `req_to_token[req.req_pool_idx, :len(token_ids)]`, the first
        `len(req.prefix_indices)` of them the tree's slots (locked through `req.last_node`), the rest the request's
        own. The page-aligned part is inserted; the request's own slots for tokens the tree already had, and its
        unaligned tail page, are freed here. The request row itself is not freed. Call once per request.
        """
        own_start, num_aligned, row = self._request_slots(req, token_ids)
        present = own_start
        if num_aligned > 0:
            present = self._insert(self._namespace_root(req.namespace, create=True), token_ids, num_aligned, row)
            self._check_prefix_held(req, present, own_start)
        self.allocator.free(torch.cat([row[own_start:present], row[num_aligned:]]))
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """Cache the KV a still-running request has computed so far (chunked prefill), keeping it locked.

        Same inputs as `cache_finished_req`. Inserts the page-aligned part, frees the request's copies of tokens
        the tree already had and writes the tree's slots into the request's row in their place, moves the lock to
        the new last node, and sets `req.prefix_indices` (the tree's slots, length = the aligned part) and
        `req.last_node`. The unaligned tail, `req_to_token[row, len(req.prefix_indices):len(token_ids)]`, stays
        owned by the request.
        """
        own_start, num_aligned, row = self._request_slots(req, token_ids)
        if num_aligned == own_start:
            return  # no whole page beyond what the request already holds through the tree
        ns_root = self._namespace_root(req.namespace, create=True)
        present = self._insert(ns_root, token_ids, num_aligned, row)
        self._check_prefix_held(req, present, own_start)
        match = self._match(ns_root, token_ids, num_aligned, touch=False)
        assert match.length == num_aligned, "an insert must be matchable right after it"
        self._adopt_duplicates(row[own_start:present], match.indices[own_start:present])
        self._free_duplicates(row[own_start:present])
        req_row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        req_row[own_start:present] = match.indices[own_start:present].to(req_row.dtype)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def _adopt_duplicates(self, own_slots: torch.Tensor, tree_slots: torch.Tensor) -> None:
        """Before a chunk's own copies of cached tokens are freed: what of them the tree's slots lack, the tree takes
        (the window KV of a sliding-window model, radix_cache/swa.py); nothing here."""

    def _free_duplicates(self, slots: torch.Tensor) -> None:
        """Free a chunk's own slots for tokens the tree already had. The batch being built still writes them, which
        is harmless: any later user of a freed slot is a later batch (the hierarchical cache defers these)."""
        self.allocator.free(slots)

    def _request_slots(self, req: Any, token_ids: list[int]) -> tuple[int, int, torch.Tensor]:
        num_tokens = len(token_ids)
        own_start = len(req.prefix_indices)
        if own_start > num_tokens or own_start % self.page_size:
            raise ValueError(f"prefix of {own_start} tokens does not fit {num_tokens} tokens in whole pages")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :num_tokens].to(torch.int64, copy=True)
        return own_start, num_tokens - num_tokens % self.page_size, row

    @staticmethod
    def _check_prefix_held(req: Any, present: int, own_start: int) -> None:
        # The request's prefix is locked, hence still in the tree: anything else means its prefix_indices,
        # last_node or namespace do not describe the same tokens, and freeing would corrupt ownership.
        if present < own_start:
            raise AssertionError(f"request prefix of {own_start} tokens is not in the tree (found {present})")

    # ---- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, held_slots: int = 0) -> None:
        """Raise AssertionError unless the tree and the slot accounting are consistent.

        `held_slots`: slots owned only by running requests (their own pages, in whole pages, not in the tree).
        Checks `allocator.size == free + evictable + protected + held`, lock counts, key/value shapes, links,
        the evictable/protected counters and the eviction queue against a full recomputation.
        """
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise AssertionError(f"radix cache invariant violated: {message}")

        page_size = self.page_size
        root = self.root
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
        require(num_nodes == self._num_nodes, f"node count {self._num_nodes} != {num_nodes} found")
        require(evictable == self._evictable, f"evictable_size {self._evictable} != {evictable} recomputed")
        require(protected == self._protected, f"protected_size {self._protected} != {protected} recomputed")
        queued = self._queue.live_nodes()
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
        free = self.allocator.available_size()
        require(self.allocator.size == free + evictable + protected + held_slots,
                f"slot accounting: size {self.allocator.size} != free {free} + evictable {evictable} "
                f"+ protected {protected} + held {held_slots}")

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
