"""Scheduling policies and admission budgets, on a real RadixCache over real KV pools (no model needed)."""

from __future__ import annotations

import pytest

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.tree import RadixCache
from radixserve.runtime.wire.messages import SamplingParams
from radixserve.scheduler.policy import (
    LEADING_TOKENS,
    PREFIX_POLICY_MAX_QUEUE,
    NewTokenRatio,
    PrefillAdder,
    SchedulePolicy,
)
from radixserve.scheduler.req import Req


def make_cache(page_size: int = 1) -> RadixCache:
    allocator = KVAllocator(4096, page_size)
    return RadixCache(ReqToTokenPool(8, 512), allocator, page_size)


def cache_tokens(cache: RadixCache, tokens: list[int], namespace: tuple = ()) -> None:
    slots = cache.allocator.alloc(len(tokens))
    present = cache.insert(tokens, slots, namespace)
    cache.allocator.free(slots[:present])


def req(rid: str, ids: list[int], max_new_tokens: int = 8, namespace: tuple = ()) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new_tokens), namespace)


def test_fcfs_keeps_queue_order():
    waiting = [req(str(i), [i, 1, 2]) for i in range(5)]
    assert SchedulePolicy("fcfs", make_cache(), True).order(waiting) == waiting


def test_lpm_puts_longest_cached_prefix_first():
    cache = make_cache()
    cache_tokens(cache, list(range(100)))
    cache_tokens(cache, [7] * 40)
    waiting = [
        req("none", [500, 501, 502]),
        req("short", list(range(10)) + [999]),
        req("long", list(range(80)) + [999]),
        req("other", [7] * 30 + [1]),
        req("salted", list(range(80)) + [999], namespace=("", "salt:x")),  # nothing cached in its namespace
    ]
    ordered = SchedulePolicy("lpm", cache, True).order(waiting)
    assert [r.rid for r in ordered] == ["long", "other", "short", "none", "salted"]
    # Without sharing, prefix-aware policies are fcfs.
    assert SchedulePolicy("lpm", cache, False).order(waiting) == waiting


def test_dfs_weight_runs_a_subtree_back_to_back_heaviest_first():
    cache = make_cache()
    a, b = [1] * 50, [2] * 50
    cache_tokens(cache, a)
    cache_tokens(cache, b)
    waiting = [req("a1", a + [10]), req("b1", b + [10]), req("x", [3, 4]), req("b2", b + [11]), req("b3", b + [12]),
               req("a2", a + [11])]
    ordered = [r.rid for r in SchedulePolicy("dfs-weight", cache, True).order(waiting)]
    assert sorted(ordered) == sorted(r.rid for r in waiting)
    # Requests at a node come before its subtrees (x matched nothing: it sits at the namespace root); then the
    # b subtree (3 requests) runs back to back, then a's (2).
    assert ordered == ["x", "b1", "b2", "b3", "a1", "a2"]


def test_a_long_queue_runs_requests_that_begin_alike_back_to_back():
    system = {name: [base + i for i in range(LEADING_TOKENS)] for name, base in (("a", 100), ("b", 300), ("c", 500))}
    arrivals = "abcbaacbcb" * 20  # more than PREFIX_POLICY_MAX_QUEUE requests, nothing cached yet
    waiting = [req(f"{name}{i}", system[name] + [i]) for i, name in enumerate(arrivals)]
    waiting.append(req("a-salted", system["a"] + [1], namespace=("", "salt:x")))  # same tokens, other namespace
    assert len(waiting) > PREFIX_POLICY_MAX_QUEUE
    for name in ("lpm", "dfs-weight"):
        ordered = SchedulePolicy(name, make_cache(), True).order(waiting)
        groups = [r.rid[0] if r.rid != "a-salted" else "salted" for r in ordered]
        count = {g: groups.count(g) for g in "abc"}
        assert groups == ["a"] * count["a"] + ["b"] * count["b"] + ["c"] * count["c"] + ["salted"]
        for group in "abc":  # queue order within a group
            members = [r for r in ordered if r.rid[0] == group and r.rid != "a-salted"]
            assert members == [r for r in waiting if r.rid[0] == group and r.rid != "a-salted"]
    # fcfs keeps the queue as it is, however long.
    assert SchedulePolicy("fcfs", make_cache(), True).order(waiting) == waiting


def test_a_long_queue_runs_groups_with_a_cached_prompt_first():
    """While a burst still arrives, requests whose group prompt is already cached are not held behind the first
    request of a group that arrived before them: groups rank by their first member's cached prefix."""
    system = {name: [base + i for i in range(LEADING_TOKENS + 40)] for name, base in (("a", 100), ("b", 300), ("c", 500))}
    cache = make_cache()
    cache_tokens(cache, system["c"])  # c's whole system prompt
    cache_tokens(cache, system["b"][: LEADING_TOKENS + 10])  # the first part of b's
    arrivals = "abcbaacbcb" * 20
    waiting = [req(f"{name}{i}", system[name] + [i]) for i, name in enumerate(arrivals)]
    for name in ("lpm", "dfs-weight"):
        ordered = SchedulePolicy(name, cache, True).order(waiting)
        groups = [r.rid[0] for r in ordered]
        count = {g: groups.count(g) for g in "abc"}
        assert groups == ["c"] * count["c"] + ["b"] * count["b"] + ["a"] * count["a"]
        assert [r for r in ordered if r.rid[0] == "b"] == [r for r in waiting if r.rid[0] == "b"]


def test_lof_and_random():
    waiting = [req(str(n), [1, 2], max_new_tokens=n) for n in (3, 30, 10)]
    assert [r.rid for r in SchedulePolicy("lof", make_cache(), True).order(waiting)] == ["30", "10", "3"]
    first = SchedulePolicy("random", make_cache(), True, seed=5).order(list(waiting) * 3)
    again = SchedulePolicy("random", make_cache(), True, seed=5).order(list(waiting) * 3)
    assert first == again and sorted(map(id, first)) == sorted(map(id, list(waiting) * 3))


def adder(memory: int, reserve: float = 0.0, ratio: float = 0.5, max_prefill: int = 1000,
          chunk: int | None = None, page_size: int = 1) -> PrefillAdder:
    return PrefillAdder(lambda: memory, reserve, ratio, max_prefill, chunk, page_size)


def test_adder_reserves_memory_for_outputs():
    a = adder(memory=100, reserve=25.0, ratio=0.5)
    r = req("r", [1] * 60, max_new_tokens=40)  # 60 + 40 * 0.5 = 80 > 100 - 25
    assert a.plan(r, 0, 60) == 0 and a.stopped
    b = adder(memory=100, reserve=10.0, ratio=0.5)
    assert b.plan(r, 0, 60) == 60  # 60 + 20 <= 90
    b.commit(r, 60, 60, 0)
    assert b.reserved == 20.0


def test_adder_chunks_long_prompts_page_aligned():
    a = adder(memory=10_000, chunk=100, page_size=16)
    r = req("r", [1] * 300)
    assert a.plan(r, 0, 300) == 96  # the chunk ends on a page boundary
    a.commit(r, 96, 300, 0)
    assert a.chunked and a.stopped
    # The next batch continues it: 204 tokens left, 100 fit.
    b = adder(memory=10_000, chunk=100, page_size=16)
    assert b.plan(r, 96, 300) == 96


def test_adder_max_prefill_tokens_lets_the_first_request_through():
    a = adder(memory=10_000, max_prefill=50)
    big, small = req("big", [1] * 80), req("small", [1] * 10)
    assert a.plan(big, 0, 80) == 80  # alone it may exceed the budget, or it could never run
    a.commit(big, 80, 80, 0)
    assert a.stopped and a.plan(small, 0, 10) == 0


def test_new_token_ratio_decays_and_resets():
    ratio = NewTokenRatio(1.0)
    start = ratio.value
    for _ in range(10_000):
        ratio.decay()
    assert ratio.value == pytest.approx(start * 0.14)
    ratio.reset()
    assert ratio.value == start
