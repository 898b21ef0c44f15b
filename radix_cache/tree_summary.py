"""A summary of the radix tree for people: per namespace, the nodes worth drawing and what they hold.

    summarize_tree(cache, namespace_prefix=("tenant:alpha",), max_nodes=200) -> list[NamespaceTree]

Selection. Only namespaces whose parts start with `namespace_prefix` are read at all (the caller's own; the HTTP
layer derives the prefix from the API key), optionally narrowed to one namespace by name. A large namespace is
summarized: starting under its root, the summary repeatedly takes the candidate node whose subtree holds the
most tokens x hits (ties: most tokens), then offers that node's children as candidates, until `max_nodes` nodes
are taken. Every node shown therefore has its ancestors shown too, and what is left out of a node's subtree is
counted in its `omitted_children` / `omitted_tokens`, so the shown tokens plus the omitted ones add up to the
namespace's total. The nodes of a marked request path are always shown.

Cost. One walk over the selected namespaces (O(their nodes)), run by the scheduler between steps; the summary
never changes the tree (no splits, no access times, no hit counts).
"""

from __future__ import annotations

import heapq
from typing import Any, Iterator, NamedTuple, Optional

from radixserve.radix_cache.keys import common_prefix_length
from radixserve.runtime.wire.cache_tree import CacheTier, CacheTreeNode, NamespaceTree, namespace_name

TreeNode = Any  # radix_cache.node.TreeNode (duck-typed so the no-share cache's bare root works too)




class _Aggregate(NamedTuple):
    score: int  # sum over the subtree of tokens x hits
    tokens: int
    nodes: int
    locked_tokens: int


def summarize_tree(
    cache: Any,
    namespace_prefix: tuple = (),
    namespace: Optional[str] = None,
    max_depth: int = 0,
    max_nodes: int = 200,
    with_token_ids: bool = False,
    path_tokens: Optional[tuple[tuple, list[int]]] = None,
    first_id: int = 0,
) -> tuple[list[NamespaceTree], list[int], int]:
    """The selected namespaces of `cache` (a RadixCache or NoShareCache), the default one first, then by name.
    `max_nodes` >= 1 per namespace; `max_depth` 0 means no limit (CacheTreeReq checks both).

    `path_tokens`: (namespace, token ids) of a request whose path to keep in the summary. Returns the namespace
    trees, the ids of the path's nodes (top-down; empty without a path or when its namespace is not selected),
    and the number of its tokens the tree holds.
    """
    stats = cache.stats().get("namespaces", {})
    roots = {ns: root for ns, root in cache.root.children.items() if _selected(ns, namespace_prefix, namespace)}
    names = set(roots) | {ns for ns in stats if _selected(ns, namespace_prefix, namespace)}
    page_size = getattr(cache, "page_size", 1)
    trees, path_ids, path_cached = [], [], 0
    next_id = first_id
    for ns in sorted(names, key=lambda ns: (ns != (), ns)):
        path_nodes: list[TreeNode] = []
        if path_tokens is not None and path_tokens[0] == ns and ns in roots:
            path_nodes, path_cached = _walk_path(roots[ns], path_tokens[1], page_size)
        tree, ids = _namespace_tree(ns, roots.get(ns), stats.get(ns, {}), max_depth, max_nodes, with_token_ids,
                                    path_nodes, next_id)
        path_ids = ids or path_ids
        next_id += len(tree.nodes)
        trees.append(tree)
    return trees, path_ids, path_cached


def _selected(ns: tuple, prefix: tuple, name: Optional[str]) -> bool:
    return ns[:len(prefix)] == prefix and (name is None or namespace_name(ns) == name)


def _walk_path(ns_root: TreeNode, token_ids: list[int], page_size: int) -> tuple[list[TreeNode], int]:
    """The nodes `token_ids` run through (without splitting any), and how many of its tokens they hold; a node
    where the tokens diverge midway is included, as it holds the start of their path."""
    nodes, node, pos = [], ns_root, 0
    while pos < len(token_ids):
        child = node.children.get(token_ids[pos] if page_size == 1 else tuple(token_ids[pos:pos + page_size]))
        if child is None:
            break
        matched = common_prefix_length(child.key, token_ids, pos, len(token_ids))
        matched -= matched % page_size
        if matched == 0:
            break
        nodes.append(child)
        pos += matched
        if matched < len(child.key):
            break
        node = child
    return nodes, pos


def _aggregates(ns_root: TreeNode) -> dict[int, _Aggregate]:
    """Subtree totals of every node below `ns_root`, keyed by id(node), computed bottom-up without recursion."""
    order, stack = [], list(ns_root.children.values())
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    totals: dict[int, _Aggregate] = {}
    for node in reversed(order):  # children come after their parent in `order`
        tokens = len(node.key)
        score, nodes, locked = tokens * node.hit_count, 1, tokens if node.lock_ref else 0
        for child in node.children.values():
            below = totals[id(child)]
            score += below.score
            tokens += below.tokens
            nodes += below.nodes
            locked += below.locked_tokens
        totals[id(node)] = _Aggregate(score, tokens, nodes, locked)
    return totals


def _namespace_tree(ns: tuple, ns_root: Optional[TreeNode], stats: dict, max_depth: int, max_nodes: int,
                    with_token_ids: bool, path_nodes: list[TreeNode], first_id: int) -> tuple[NamespaceTree, list[int]]:
    totals = _aggregates(ns_root) if ns_root is not None else {}
    top = list(ns_root.children.values()) if ns_root is not None else []
    chosen = _choose(top, totals, max_depth, max_nodes, path_nodes)
    nodes: list[CacheTreeNode] = []
    ids: dict[int, int] = {}
    for node, depth, prefix_tokens, parent in _shown(top, chosen, totals):
        total = totals[id(node)]
        omitted = [c for c in node.children.values() if id(c) not in chosen]
        node_id = first_id + len(nodes)
        ids[id(node)] = node_id
        nodes.append(CacheTreeNode(
            id=node_id, parent=-1 if parent is None else ids[id(parent)], depth=depth, tokens=len(node.key),
            prefix_tokens=prefix_tokens, subtree_tokens=total.tokens, hits=node.hit_count,
            last_access=node.last_access_time, lock_ref=node.lock_ref, tier=CacheTier.DEVICE,
            omitted_children=len(omitted), omitted_tokens=sum(totals[id(c)].tokens for c in omitted),
            token_ids=list(node.key) if with_token_ids else None,
        ))
    whole = [totals[id(c)] for c in top]
    tree = NamespaceTree(
        name=namespace_name(ns),
        num_nodes=sum(t.nodes for t in whole),
        num_tokens=sum(t.tokens for t in whole),
        num_top_level=len(top),
        locked_tokens=sum(t.locked_tokens for t in whole),
        queried_tokens=int(stats.get("queried_tokens", 0)),
        matched_tokens=int(stats.get("matched_tokens", 0)),
        inserted_tokens=int(stats.get("inserted_tokens", 0)),
        evicted_tokens=int(stats.get("evicted_tokens", 0)),
        hit_rate=float(stats.get("hit_rate", 0.0)),
        truncated=len(nodes) < sum(t.nodes for t in whole),
        nodes=nodes,
    )
    return tree, [ids[id(node)] for node in path_nodes if id(node) in ids]


def _choose(top: list[TreeNode], totals: dict[int, _Aggregate], max_depth: int, max_nodes: int,
            path_nodes: list[TreeNode]) -> set[int]:
    """ids of the nodes to show: the request path's, then the heaviest subtrees first (see the module doc)."""
    chosen: set[int] = set()
    candidates: list[tuple[int, int, int, int, TreeNode]] = []
    tie = 0

    def offer(node: TreeNode, depth: int) -> None:
        nonlocal tie
        if max_depth and depth > max_depth:
            return
        total = totals[id(node)]
        heapq.heappush(candidates, (-total.score, -total.tokens, tie, depth, node))
        tie += 1

    chosen.update(id(node) for node in path_nodes)
    for node in top:
        if id(node) not in chosen:
            offer(node, 1)
    for depth, node in enumerate(path_nodes, start=1):
        for child in node.children.values():
            if id(child) not in chosen:
                offer(child, depth + 1)
    while candidates and len(chosen) < max_nodes:
        *_, depth, node = heapq.heappop(candidates)
        if id(node) in chosen:
            continue
        chosen.add(id(node))
        for child in node.children.values():
            offer(child, depth + 1)
    return chosen


def _shown(top: list[TreeNode], chosen: set[int], totals: dict[int, _Aggregate]) -> Iterator[tuple]:
    """(node, depth, prefix_tokens, parent node or None) of the chosen nodes, depth-first (a parent before its
    children), larger subtrees first."""
    def smallest_first(nodes: Any) -> list[TreeNode]:  # the stack pops the largest first
        return sorted((n for n in nodes if id(n) in chosen), key=lambda n: totals[id(n)].tokens)

    stack = [(node, 1, 0, None) for node in smallest_first(top)]
    while stack:
        node, depth, above, parent = stack.pop()
        prefix_tokens = above + len(node.key)
        yield node, depth, prefix_tokens, parent
        stack.extend((child, depth + 1, prefix_tokens, node) for child in smallest_first(node.children.values()))
