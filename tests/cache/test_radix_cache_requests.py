"""Request-level use of the caches, as the scheduler drives them, on a real KVAllocator and ReqToTokenPool.

A `Sim` plays the scheduler's part: admit (match and lock a prefix), compute tokens (allocate and write the
request's row), chunk boundaries (`cache_unfinished_req`), finish or abort (`cache_finished_req`). After every
step it checks single ownership of every page (free list, tree, running requests: disjoint and complete) and that
every slot the cache hands out holds the KV of the same tokens in the same namespace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from radixserve.radix_cache.no_share import NoShareCache
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.tree import RadixCache

PAGE_SIZES = [1, 4, 16]


@dataclass
class Req:
    tokens: list[int]  # every token the request will have KV for (prompt and output)
    namespace: tuple = ()
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    num_computed: int = 0  # tokens whose KV is in the request's row


def tree_pages(cache) -> list[int]:
    """Pages held by the tree, found by walking it from the root."""
    pages, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        pages.extend((node.value // cache.page_size).unique().tolist())
    return pages


class Sim:
    def __init__(self, cache_cls, page_size: int, num_pages: int = 48, rows: int = 6, eviction_policy: str = "lru"):
        self.page_size = page_size
        self.pool = ReqToTokenPool(rows, 40 * page_size)
        self.allocator = KVAllocator(num_pages * page_size, page_size)
        self.cache = cache_cls(self.pool, self.allocator, page_size, eviction_policy)
        self.running: list[Req] = []
        self.kv_content: dict[int, tuple] = {}  # slot -> (namespace, tokens up to and including this one)

    # ---- the scheduler's steps -------------------------------------------------------------------------
    def admit(self, req: Req) -> int:
        req.req_pool_idx = self.pool.alloc()
        assert req.req_pool_idx is not None
        match = self.cache.match_prefix(req.tokens[:-1], req.namespace)  # the last token is always computed
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node, req.num_computed = match.indices, match.last_node, match.length
        self.row(req)[:match.length] = match.indices.to(torch.int32)
        for i, slot in enumerate(match.indices.tolist()):
            assert self.kv_content[slot] == (req.namespace, tuple(req.tokens[:i + 1])), "matched a wrong KV slot"
        self.running.append(req)
        return match.length

    def compute(self, req: Req, num_tokens: int) -> bool:
        """Allocate and 'compute' the next tokens; evicts when short. False when memory stays short."""
        own = req.num_computed > len(req.prefix_indices)
        last_slot = int(self.row(req)[req.num_computed - 1]) if own else -1
        slots = self.allocator.alloc_extend([last_slot], [num_tokens])
        if slots is None:
            self.cache.evict(num_tokens + self.page_size)
            slots = self.allocator.alloc_extend([last_slot], [num_tokens])
            if slots is None:
                return False
        start = req.num_computed
        self.row(req)[start:start + num_tokens] = slots.to(torch.int32)
        for i, slot in enumerate(slots.tolist(), start):
            self.kv_content[slot] = (req.namespace, tuple(req.tokens[:i + 1]))
        req.num_computed += num_tokens
        return True

    def chunk_boundary(self, req: Req) -> None:
        self.cache.cache_unfinished_req(req, req.tokens[:req.num_computed])

    def finish(self, req: Req) -> None:
        """Also the abort and retract path: whatever KV the request has goes through the cache."""
        self.cache.cache_finished_req(req, req.tokens[:req.num_computed])
        self.pool.free(req.req_pool_idx)
        self.running.remove(req)

    # ---- checks ----------------------------------------------------------------------------------------
    def row(self, req: Req) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx]

    def own_pages(self, req: Req) -> list[int]:
        own = self.row(req)[len(req.prefix_indices):req.num_computed].to(torch.int64)
        return (own // self.page_size).unique().tolist()

    def check(self) -> None:
        page_size = self.page_size
        held = [page for req in self.running for page in self.own_pages(req)]
        self.cache.check_invariants(held_slots=len(held) * page_size)
        self.allocator.available_size()
        free = self.allocator.free_page_list()
        owned = free + tree_pages(self.cache) + held
        assert len(owned) == len(set(owned)), "a page has two owners (or was freed twice)"
        assert sorted(owned) == list(range(1, self.allocator.num_pages + 1)), "a page was leaked"
        for req in self.running:
            prefix = req.prefix_indices.tolist()
            assert self.row(req)[:len(prefix)].tolist() == prefix
            for i, slot in enumerate(self.row(req)[:req.num_computed].tolist()):
                assert self.kv_content[slot] == (req.namespace, tuple(req.tokens[:i + 1]))
        assert self.cache.protected_size() <= sum(len(req.prefix_indices) for req in self.running)

    def check_idle(self) -> None:
        assert not self.running and self.cache.protected_size() == 0
        self.check()
        assert self.allocator.available_size() + self.cache.evictable_size() == self.allocator.size
        self.cache.reset()
        assert self.allocator.available_size() == self.allocator.size


def run_to_completion(sim: Sim, req: Req, chunk: int | None = None) -> None:
    """Compute the rest of `req` (in chunks of `chunk` tokens if given) and finish it, checking each step."""
    while req.num_computed < len(req.tokens):
        step = min(chunk or len(req.tokens), len(req.tokens) - req.num_computed)
        assert sim.compute(req, step)
        sim.check()
        if chunk and req.num_computed < len(req.tokens):
            sim.chunk_boundary(req)
            sim.check()
    sim.finish(req)
    sim.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_second_request_reuses_the_first_ones_prefix(page_size):
    sim = Sim(RadixCache, page_size)
    system = [7] * (2 * page_size + 3)
    first = Req(system + [1, 2, 3])
    assert sim.admit(first) == 0
    run_to_completion(sim, first)
    first_slots = sim.cache.match_prefix(system).indices.tolist()
    second = Req(system + [4, 5])
    shared = len(system) - len(system) % page_size  # whole pages of the shared system prompt
    assert sim.admit(second) == shared
    assert second.prefix_indices.tolist() == first_slots[:shared]
    sim.check()
    run_to_completion(sim, second)
    sim.check_idle()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_concurrent_duplicates_are_freed_once(page_size):
    sim = Sim(RadixCache, page_size)
    tokens = list(range(3 * page_size + 1))
    first, second = Req(tokens), Req(tokens + [99])
    sim.admit(first), sim.admit(second)  # neither finds anything: both compute the same prompt
    for req in (first, second):
        assert sim.compute(req, len(req.tokens))
    sim.check()
    sim.finish(first)
    sim.check()
    free_before = sim.allocator.available_size()
    sim.finish(second)  # its copy of the prompt's whole pages is a duplicate: freed, with its tail
    sim.check()
    assert sim.allocator.available_size() == free_before + 4 * page_size
    assert sim.cache.total_size() == len(second.tokens) - len(second.tokens) % page_size
    sim.check_idle()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prefill_moves_the_lock_and_keeps_the_tail(page_size):
    sim = Sim(RadixCache, page_size)
    req = Req([3, 1, 4, 1, 5, 9, 2, 6] * (page_size + 1))
    sim.admit(req)
    chunk = page_size + 3  # chunk ends fall inside pages
    while req.num_computed + chunk < len(req.tokens):
        old_node = req.last_node
        assert sim.compute(req, chunk)
        sim.chunk_boundary(req)
        aligned = req.num_computed - req.num_computed % page_size
        assert len(req.prefix_indices) == aligned
        assert sim.cache.protected_size() == aligned  # only this request's lock remains
        assert req.last_node is not old_node or aligned == 0
        match = sim.cache.match_prefix(req.tokens[:req.num_computed])
        assert match.length == aligned and match.indices.tolist() == req.prefix_indices.tolist()
        assert len(sim.own_pages(req)) == (0 if aligned == req.num_computed else 1)  # just the partial tail page
        sim.check()
    run_to_completion(sim, req)
    sim.check_idle()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunk_of_tokens_another_request_cached_meanwhile(page_size):
    sim = Sim(RadixCache, page_size)
    tokens = list(range(5 * page_size))
    chunked, other = Req(tokens), Req(tokens[:4 * page_size] + [1000])
    sim.admit(chunked), sim.admit(other)
    assert sim.compute(chunked, 2 * page_size + 1)
    sim.chunk_boundary(chunked)
    cached_by_chunked = len(chunked.prefix_indices)
    run_to_completion(sim, other)  # caches 4 pages, some of which `chunked` is computing on its own
    assert sim.compute(chunked, 2 * page_size)
    before = sim.allocator.available_size()
    sim.chunk_boundary(chunked)  # its copies of those pages are duplicates now
    assert sim.allocator.available_size() == before + 4 * page_size - cached_by_chunked
    other_slots = sim.cache.match_prefix(tokens[:4 * page_size]).indices.tolist()
    assert sim.row(chunked)[:4 * page_size].tolist() == other_slots
    sim.check()
    run_to_completion(sim, chunked)
    sim.check_idle()


@pytest.mark.parametrize("cache_cls", [RadixCache, NoShareCache])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_abort_mid_prefill_releases_everything(cache_cls, page_size):
    sim = Sim(cache_cls, page_size)
    req = Req(list(range(6 * page_size)))
    sim.admit(req)
    assert sim.compute(req, 2 * page_size + 1)
    sim.chunk_boundary(req)
    assert sim.compute(req, page_size)
    sim.check()
    sim.finish(req)  # abort: the KV computed so far goes through the normal path
    sim.check_idle()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_no_share_cache_never_shares(page_size):
    sim = Sim(NoShareCache, page_size)
    tokens = list(range(3 * page_size + 2))
    first = Req(tokens)
    assert sim.admit(first) == 0
    run_to_completion(sim, first, chunk=page_size + 1)
    second = Req(tokens)
    assert sim.admit(second) == 0 and sim.cache.total_size() == 0
    run_to_completion(sim, second)
    assert sim.cache.stats()["matched_tokens"] == 0
    sim.check_idle()


def random_workload(sim: Sim, seed: int, steps: int) -> None:
    """Requests built from a few shared prompts, admitted, chunked, finished, aborted and retracted at random;
    memory is small enough that eviction and retraction happen."""
    rng = random.Random(seed)
    page_size = sim.page_size
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 3 * page_size + 2))] for _ in range(4)]
    namespaces = [(), ("tenant-a",), ("tenant-a", "salt")]
    waiting: list[Req] = []
    for _ in range(steps):
        action = rng.random()
        if action < 0.3 and sim.pool.available_size():
            if waiting and rng.random() < 0.5:
                req = waiting.pop(0)
            else:
                tokens = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(1, 4 * page_size))]
                req = Req(tokens, rng.choice(namespaces))
            sim.admit(req)
        elif action < 0.75 and sim.running:
            req = rng.choice(sim.running)
            remaining = len(req.tokens) - req.num_computed
            if remaining == 0:
                sim.finish(req)
            elif not sim.compute(req, rng.randint(1, min(remaining, 2 * page_size + 1))):
                sim.finish(req)  # retract: release its KV, retry later from scratch
                waiting.append(Req(req.tokens, req.namespace))
            elif req.num_computed < len(req.tokens) and rng.random() < 0.5:
                sim.chunk_boundary(req)
        elif action < 0.85 and sim.running:
            sim.finish(rng.choice(sim.running))  # abort
        elif action < 0.9:
            sim.cache.evict(rng.randrange(4 * page_size))
        sim.check()
    for req in list(sim.running):
        sim.finish(req)
    sim.check_idle()


@pytest.mark.parametrize("num_pages", [14, 40])  # 14: running requests outgrow memory and get retracted
@pytest.mark.parametrize("cache_cls", [RadixCache, NoShareCache])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_random_workload(cache_cls, page_size, num_pages):
    sim = Sim(cache_cls, page_size, num_pages=num_pages)
    random_workload(sim, seed=page_size, steps=600)
    if cache_cls is RadixCache:
        stats = sim.cache.stats()
        assert stats["matched_tokens"] > 0 and stats["evicted_tokens"] > 0


def test_random_workload_lfu():
    random_workload(Sim(RadixCache, 4, num_pages=40, eviction_policy="lfu"), seed=7, steps=600)
