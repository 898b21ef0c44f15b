"""The data-parallel controller's pieces in-process: the approximate prefix tree (checked against a real
RadixCache whose evictions are mirrored through the replica reporter's messages), the load balancer's policies,
and the merging of the replicas' control replies."""

from __future__ import annotations

import random

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.tree import RadixCache
from radixserve.runtime.data_parallel.policy import LoadBalancer, LoadEstimate
from radixserve.runtime.data_parallel.prefix_tree import ApproxPrefixTree
from radixserve.runtime.wire.messages import FlushCacheReqOutput
from radixserve.scheduler.replica_report import evicted_prefix
from radixserve.tokenizer_manager.replicas import merge_replies

NS = ("tenant-a",)


def test_tree_match_insert_split_and_forget():
    tree = ApproxPrefixTree()
    tree.insert(NS, [1, 2, 3, 4, 5], 0)
    tree.insert(NS, [1, 2, 3, 9], 1)
    assert tree.match(NS, [1, 2, 3, 4, 7]) == {0: 4, 1: 3}
    assert tree.match(("other",), [1, 2, 3]) == {}  # namespaces never share
    assert tree.replica_tokens(0) == 5 and tree.replica_tokens(1) == 4
    tree.forget(NS, [1, 2, 3, 4, 5], kept=2, replica=0)  # replica 0 evicted all but [1, 2]
    assert tree.match(NS, [1, 2, 3, 4, 7]) == {0: 2, 1: 3}
    assert tree.replica_tokens(0) == 2
    tree.forget(NS, [1, 2, 7, 7], kept=2, replica=1)  # a path the tree never saw: nothing changes
    assert tree.match(NS, [1, 2, 3, 9]) == {0: 2, 1: 4}
    tree.drop_replica(1)
    assert tree.match(NS, [1, 2, 3, 9]) == {0: 2}
    assert tree.num_tokens == 2 and tree.replica_tokens(1) == 0


def test_tree_stays_within_its_size_by_dropping_least_recent_prefixes():
    tree = ApproxPrefixTree(max_tokens=100)
    for i in range(20):
        tree.insert(NS, [i] * 10, i % 2)
    assert tree.num_tokens <= 100
    assert tree.match(NS, [19] * 10) == {1: 10}  # the newest survive
    assert tree.match(NS, [0] * 10) == {}
    assert sum(tree.tokens_by_replica.values()) == tree.num_tokens


def test_tree_mirrors_a_real_radix_cache_through_eviction_reports():
    """Everything inserted into a real tree is inserted into the approximate one; every eviction the real tree
    reports (as the replica reporter does) is forgotten: the approximate match equals the real one."""
    rng = random.Random(0)
    cache = RadixCache(ReqToTokenPool(2, 8), KVAllocator(64, 1), 1)
    reports = []

    class Listener:
        def evicted(self, leaf):
            reports.append(evicted_prefix(leaf))

        def reset(self):
            reports.clear()

    cache.eviction_listener = Listener()
    tree = ApproxPrefixTree()
    for _ in range(300):
        namespace = rng.choice([(), NS])
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.6:
            need = len(tokens) - cache.match_prefix(tokens, namespace).length
            if cache.allocator.available_size() < need:
                cache.evict(need)
            if cache.allocator.available_size() >= len(tokens):
                slots = cache.allocator.alloc(len(tokens))
                cache.insert(tokens, slots, namespace)
                tree.insert(namespace, tokens, 0)
        else:
            cache.evict(rng.randint(1, 16))
        for report in reports:
            tree.forget(report.namespace, report.tokens, report.kept, 0)
        reports.clear()
        probe = [rng.randint(0, 2) for _ in range(12)]
        assert tree.match(namespace, probe).get(0, 0) == cache.match_prefix(probe, namespace).length


def test_round_robin_and_queue_policies():
    loads = [LoadEstimate(3, 100), LoadEstimate(1, 900), LoadEstimate(2, 50)]
    rr = LoadBalancer("round_robin", 3)
    assert [rr.choose(NS, [1], loads) for _ in range(4)] == [0, 1, 2, 0]
    assert LoadBalancer("shortest_queue", 3).choose(NS, [1], loads) == 1
    assert LoadBalancer("minimum_tokens", 3).choose(NS, [1], loads) == 2


def test_cache_aware_follows_the_prefix_until_the_load_is_imbalanced():
    balancer = LoadBalancer("cache_aware", 2, cache_threshold=0.5, balance_abs_threshold=4,
                            balance_rel_threshold=1.5)
    even = [LoadEstimate(0, 0), LoadEstimate(0, 0)]
    first = balancer.choose(NS, list(range(100)), even)
    other = balancer.choose(NS, [7] * 100, even)
    assert other != first  # a new prefix goes where less is cached
    assert balancer.choose(NS, list(range(90)) + [5] * 10, even) == first  # 90% of it is on `first`
    assert balancer.choose(("b",), list(range(100)), even) == other  # another namespace: no match, spread
    busy = [LoadEstimate(0, 0), LoadEstimate(0, 0)]
    busy[first] = LoadEstimate(10, 0)
    assert balancer.choose(NS, list(range(100)), busy) == other  # imbalanced: the idle replica
    assert balancer.decisions["balance"] == 1
    busy = [LoadEstimate(0, 0), LoadEstimate(0, 0)]
    busy[other] = LoadEstimate(4, 0)  # past the relative threshold but within the absolute one
    assert balancer.choose(NS, [7] * 100, busy) == other


def test_replies_merge_into_one_answer():
    refused = merge_replies([FlushCacheReqOutput("x", True), FlushCacheReqOutput("x", False, "busy")])
    assert refused.success is False and refused.message == "busy"
    assert merge_replies([FlushCacheReqOutput("x", True), FlushCacheReqOutput("x", True)]).success
    # The server-info merge (sums, recomputed rates, the replicas by rank): tests/engine/test_server_info.py.
