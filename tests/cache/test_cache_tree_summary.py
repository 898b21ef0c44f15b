"""The radix tree summary (radix_cache/tree_summary.py) on real trees, against a brute-force walk of the tree.

What a reader of the cache page relies on: the totals are the tree's; what is left out is counted where it was
left out; the nodes kept are the heaviest by tokens x hits (with their ancestors); namespaces outside the
selection are never read; a request's path is found without changing the tree; the summary crosses the wire.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.tree import RadixCache
from radixserve.radix_cache.tree_summary import namespace_name, summarize_tree
from radixserve.runtime.wire.cache_tree import CacheTier, CacheTreeReq, CacheTreeReqOutput, CacheTreeSummary
from radixserve.runtime.wire.messages import decode, encode
from radixserve.scheduler.cache_view import RecentRequests

NAMESPACES = [(), ("tenant:a",), ("tenant:a", "salt:x"), ("tenant:ab",), ("tenant:b",)]


def make_cache(size: int = 20000, page_size: int = 1) -> RadixCache:
    return RadixCache(ReqToTokenPool(2, 8), KVAllocator(size, page_size), page_size)


def cache_sequence(cache: RadixCache, token_ids: list[int], namespace: tuple = ()) -> int:
    """What a request does: match (counting hits), then insert its tokens, freeing the duplicates it computed."""
    match = cache.match_prefix(token_ids, namespace)
    own = cache.allocator.alloc(len(token_ids) - match.length)
    slots = torch.cat([match.indices, own])
    present = cache.insert(token_ids, slots, namespace)
    if present > match.length:
        cache.allocator.free(slots[match.length:present])
    return match.length


def random_workload(cache: RadixCache, rng: random.Random, num_requests: int = 300) -> list[tuple[tuple, list[int]]]:
    """Shared prefixes of several depths, repeated with skew, so hits and sizes vary a lot between subtrees."""
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    sent = []
    for _ in range(num_requests):
        namespace = rng.choice(NAMESPACES)
        base = prefixes[min(int(rng.expovariate(0.4)), len(prefixes) - 1)]
        ids = base + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        if ids:
            cache_sequence(cache, ids, namespace)
            sent.append((namespace, ids))
    return sent


def reference_subtrees(cache: RadixCache) -> dict[int, tuple[int, int]]:
    """id(node) -> (sum of tokens x hits, tokens) over its subtree, by plain recursion."""
    out = {}

    def visit(node) -> tuple[int, int]:
        score, tokens = len(node.key) * node.hit_count, len(node.key)
        for child in node.children.values():
            child_score, child_tokens = visit(child)
            score, tokens = score + child_score, tokens + child_tokens
        out[id(node)] = (score, tokens)
        return score, tokens

    for ns_root in cache.root.children.values():
        for child in ns_root.children.values():
            visit(child)
    return out


def tree_state(cache: RadixCache) -> list:
    return sorted((namespace_name(n.namespace), tuple(n.key), n.hit_count, n.last_access, n.lock_ref)
                  for n in cache._nodes())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_nodes", [1, 7, 40, 5000])
def test_totals_and_omitted_counts_add_up(seed, max_nodes):
    cache = make_cache()
    random_workload(cache, random.Random(seed))
    trees, _, _ = summarize_tree(cache, max_nodes=max_nodes)
    assert sum(t.num_tokens for t in trees) == cache.total_size()
    assert sum(t.num_nodes for t in trees) == len(cache._nodes())
    for tree in trees:
        ns_root = cache.root.children[next(ns for ns in cache.root.children if namespace_name(ns) == tree.name)]
        assert tree.num_top_level == len(ns_root.children)
        assert len(tree.nodes) == min(max_nodes, tree.num_nodes)
        assert tree.truncated == (len(tree.nodes) < tree.num_nodes)
        by_id = {node.id: node for node in tree.nodes}
        top = [node for node in tree.nodes if node.parent == -1]
        # Shown tokens + tokens folded into "omitted" == the namespace's tokens, whatever was left out.
        shown = sum(node.tokens + node.omitted_tokens for node in tree.nodes)
        top_omitted = tree.num_tokens - sum(node.subtree_tokens for node in top)
        assert shown + top_omitted == tree.num_tokens
        for node in tree.nodes:
            assert node.tier == CacheTier.DEVICE and node.token_ids is None
            children = [c for c in tree.nodes if c.parent == node.id]
            assert node.subtree_tokens == node.tokens + sum(c.subtree_tokens for c in children) + node.omitted_tokens
            if node.parent != -1:
                parent = by_id[node.parent]  # every shown node's parent is shown, before it
                assert parent.id < node.id and node.depth == parent.depth + 1
                assert node.prefix_tokens == parent.prefix_tokens + node.tokens
                assert node.hits <= parent.hits
            else:
                assert node.depth == 1 and node.prefix_tokens == node.tokens


@pytest.mark.parametrize("seed", range(4))
def test_the_heaviest_subtrees_are_the_ones_shown(seed):
    cache = make_cache()
    random_workload(cache, random.Random(100 + seed))
    weights = reference_subtrees(cache)
    trees, _, _ = summarize_tree(cache, max_nodes=12, with_token_ids=True)
    for tree in trees:
        ns = next(ns for ns in cache.root.children if namespace_name(ns) == tree.name)
        shown_keys = {(node.prefix_tokens, tuple(node.token_ids)) for node in tree.nodes}
        shown, frontier = [], []  # frontier: left out, but its parent is shown (or it is at the top)

        def visit(node, parent_shown: bool, prefix: int) -> None:
            prefix += len(node.key)
            is_shown = (prefix, tuple(node.key)) in shown_keys
            if is_shown:
                shown.append(weights[id(node)])
            elif parent_shown:
                frontier.append(weights[id(node)])
            for child in node.children.values():
                visit(child, is_shown, prefix)

        for child in cache.root.children[ns].children.values():
            visit(child, True, 0)
        assert len(shown) == len(tree.nodes)
        if frontier:
            assert max(frontier) <= min(shown), (tree.name, max(frontier), min(shown))


def test_namespace_selection_reads_only_the_selected_namespaces():
    cache = make_cache()
    for ns in NAMESPACES:
        cache_sequence(cache, [1, 2, 3, len(ns)], ns)
    names = lambda **kw: [t.name for t in summarize_tree(cache, **kw)[0]]  # noqa: E731
    salted = namespace_name(("tenant:a", "salt:x"))  # a salt is named by its digest
    assert names() == ["default", "tenant:a", salted, "tenant:ab", "tenant:b"]
    # A prefix is matched part by part: ("tenant:a",) never selects "tenant:ab".
    assert names(namespace_prefix=("tenant:a",)) == ["tenant:a", salted]
    assert names(namespace_prefix=("tenant:a",), namespace=salted) == [salted]
    assert names(namespace_prefix=("tenant:a",), namespace="tenant:b") == []
    assert names(namespace_prefix=("tenant:zzz",)) == []


def test_a_namespace_whose_tree_was_evicted_still_reports_its_counters():
    cache = make_cache()
    cache_sequence(cache, [5, 6, 7], ("tenant:a",))
    cache_sequence(cache, [5, 6, 7, 8], ("tenant:a",))
    cache.evict(100)
    (tree,), _, _ = summarize_tree(cache)
    assert (tree.name, tree.num_nodes, tree.nodes, tree.evicted_tokens) == ("tenant:a", 0, [], 4)
    assert (tree.matched_tokens, tree.queried_tokens, tree.hit_rate) == (3, 7, 3 / 7)


def test_max_depth_folds_deeper_nodes_into_their_ancestors():
    cache = make_cache()
    for tail in range(5):
        cache_sequence(cache, [1, 2, 3, 10 + tail, 20, 30 + tail])  # depth 1: [1,2,3]; depth 2: 5 children
    cache_sequence(cache, [1, 2, 3, 10, 20, 99])  # a third level under one of them
    (tree,), _, _ = summarize_tree(cache, max_depth=1)
    (node,) = tree.nodes
    assert (node.depth, node.tokens, node.omitted_children, node.subtree_tokens) == (1, 3, 5, 3 + 5 * 3 + 1)
    assert node.omitted_tokens == 5 * 3 + 1
    (tree,), _, _ = summarize_tree(cache, max_depth=2)
    assert max(n.depth for n in tree.nodes) == 2 and len(tree.nodes) == 6 and tree.truncated


def test_a_request_path_is_found_without_changing_the_tree():
    cache = make_cache()
    rng = random.Random(7)
    sent = random_workload(cache, rng, 120)
    cache.check_invariants()
    before = tree_state(cache)
    for namespace, ids in sent[-20:]:
        trees, path_ids, cached = summarize_tree(cache, max_nodes=3, with_token_ids=True, path_tokens=(namespace, ids))
        # The path's nodes are always shown, top-down, and spell out the request's tokens.
        nodes = {n.id: n for t in trees for n in t.nodes}
        spelled = [token for node_id in path_ids for token in nodes[node_id].token_ids]
        assert cached == len(ids) and spelled == ids
        assert [nodes[i].depth for i in path_ids] == list(range(1, len(path_ids) + 1))
        # A request diverging inside a node: that node holds the start of its path.
        diverged = ids + [999]
        _, path_ids, cached = summarize_tree(cache, path_tokens=(namespace, diverged))
        assert cached == len(ids)
    assert tree_state(cache) == before  # no split, no hit, no access time
    cache.check_invariants()
    # A path in another namespace than the one selected marks nothing.
    _, path_ids, _ = summarize_tree(cache, namespace_prefix=("tenant:b",), path_tokens=(("tenant:a",), [1, 2]))
    assert path_ids == []


def test_paged_tree_paths_and_totals():
    cache = make_cache(page_size=4)
    ids = list(range(1, 19))  # 18 tokens: 16 cached in whole pages
    cache_sequence(cache, ids)
    cache_sequence(cache, ids[:8] + [50, 51, 52, 53])
    (tree,), path_ids, cached = summarize_tree(cache, path_tokens=((), ids))
    assert tree.num_tokens == cache.total_size() == 20 and cached == 16 and len(path_ids) == 2


def test_the_summary_crosses_the_wire_and_limits_are_checked():
    cache = make_cache()
    random_workload(cache, random.Random(3), 50)
    trees, path_ids, cached = summarize_tree(cache, with_token_ids=True)
    summary = CacheTreeSummary(time=1.0, page_size=1, total_slots=cache.allocator.size, namespaces=trees)
    again = decode(encode(CacheTreeReqOutput(rpc_id="x", summary=summary)))
    assert again.summary == summary and again.summary.namespaces[0].nodes[0].tier is CacheTier.DEVICE
    request = decode(encode(CacheTreeReq(rpc_id="y", namespace_prefix=("tenant:a",), max_nodes=5, rid="r")))
    assert request.namespace_prefix == ("tenant:a",) and request.max_nodes == 5
    for bad in ({"max_nodes": 0}, {"max_nodes": 10**6}, {"max_depth": -1}):
        with pytest.raises(ValueError):
            CacheTreeReq(rpc_id="z", **bad)


class _Req:
    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.namespace, self.all_ids = rid, ("tenant:a",), ids


def test_recent_requests_are_bounded_in_count_and_tokens():
    recent = RecentRequests(max_requests=3, max_tokens=10)
    for i in range(5):
        recent.record(_Req(f"r{i}", [i, i]))
    assert [recent.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    recent.record(_Req("big", list(range(7))))  # 4 requests, then 7 + 2 + 2 > 10 tokens: the two oldest go
    assert recent.get("r2") is None and recent.get("r3") is None and recent.get("r4") is not None
    recent.record(_Req("r4", [1]))  # a reused rid replaces its entry
    assert recent.get("r4") == (("tenant:a",), [1])
