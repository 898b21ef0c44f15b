"""The hierarchical radix cache (radix_cache/hiradix.py) driven the way the scheduler drives it, on real pools.

A `Harness` admits requests (match, `load_back`, lock), computes their tokens in chunks (allocate, insert with
`cache_unfinished_req` *before* writing the KV, as the scheduler inserts a batch's tokens before it runs), finishes
or aborts them (`cache_finished_req`), evicts and flushes, with small device, host and disk tiers so that every
demotion and promotion path runs. The KV written for a token encodes (namespace, the tokens up to it), so after
every step the harness checks, besides `check_invariants`:
- every page of both pools has exactly one owner (free list, one tree node, or one running request);
- every node's KV, on whichever tiers it is, is the KV of its own path's tokens, and so is every slot a running
  request reads; a load back therefore returns exactly the KV that was demoted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixserve.radix_cache.hiradix import HiRadixCache
from radixserve.radix_cache.host_pool import HostKVPool
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool

NAMESPACES = [(), ("a",), ("b",)]
NUM_LAYERS = 2


@dataclass
class Req:
    tokens: list[int]
    namespace: tuple
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    num_computed: int = 0


class Choices:
    """Draws from Hypothesis (`data`) or from a seeded generator."""

    def __init__(self, data=None, seed: int = 0) -> None:
        self.data, self.rng = data, random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high)) if self.data else self.rng.randint(low, high)

    def choice(self, options: list):
        return options[self.integer(0, len(options) - 1)]


class Harness:
    def __init__(self, tmp_dir: Optional[str], page_size: int = 1, write_policy: str = "write_through",
                 device_pages: int = 24, host_pages: int = 16, disk_pages: Optional[int] = 24, rows: int = 3) -> None:
        self.page_size = ps = page_size
        self.kv = TokenToKVPool(device_pages * ps, ps, NUM_LAYERS, 1, 2, torch.float64)
        self.allocator = KVAllocator(device_pages * ps, ps)
        self.pool = ReqToTokenPool(rows, 64 * ps)
        self.host = HostKVPool(self.kv, host_pages * ps)
        disk_capacity = None if disk_pages is None else disk_pages * ps
        self.cache = HiRadixCache(self.pool, self.allocator, self.host, ps, "lru", write_policy, tmp_dir, disk_capacity)
        self.ids: dict[tuple, float] = {}
        self.running: list[Req] = []
        self.history: list[tuple] = []

    # ---- KV contents -------------------------------------------------------------------------------
    def expected(self, namespace: tuple, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """The KV block `[n, layers, 2, 1, 2]` of tokens[start:end] (each identified by its whole prefix)."""
        ids = torch.tensor([self.ids.setdefault((namespace, tuple(tokens[:i + 1])), float(len(self.ids) + 1))
                            for i in range(start, end)], dtype=torch.float64)
        layers = torch.arange(NUM_LAYERS, dtype=torch.float64)
        k = torch.stack([ids[:, None].expand(-1, NUM_LAYERS), layers[None, :].expand(len(ids), -1)], dim=-1)
        return torch.stack([k, -k], dim=2)[:, :, :, None, :]

    def device_block(self, slots: torch.Tensor) -> torch.Tensor:
        return self.host.read_device(slots)

    def write(self, slots: torch.Tensor, req: Req, start: int) -> None:
        block = self.expected(req.namespace, req.tokens, start, start + len(slots))
        for layer in range(NUM_LAYERS):
            self.kv.k_buffer[layer][slots] = block[:, layer, 0]
            self.kv.v_buffer[layer][slots] = block[:, layer, 1]

    # ---- the scheduler's steps ---------------------------------------------------------------------
    def draw_target(self, choices) -> tuple[tuple, list[int]]:
        ps = self.page_size
        if self.history and choices.integer(0, 3) > 0:
            namespace, base = choices.choice(self.history)
            cut = len(base) - choices.integer(0, len(base))
            tail = [choices.integer(0, 2) for _ in range(choices.integer(1, 3 * ps))]
            return namespace, base[:cut] + tail
        units = [choices.integer(0, 2) for _ in range(choices.integer(1, 6))]
        return choices.choice(NAMESPACES), [u for u in units for _ in range(ps)] + [choices.integer(0, 2)]

    def admit(self, choices) -> None:
        row = self.pool.alloc()
        if row is None:
            return
        namespace, tokens = self.draw_target(choices)
        self.history = (self.history + [(namespace, tokens)])[-12:]
        req = Req(tokens, namespace, row)
        match = self.cache.load_back(self.cache.match_prefix(tokens[:-1], namespace))
        assert match.length % self.page_size == 0 and len(match.indices) == match.length
        assert torch.equal(self.device_block(match.indices), self.expected(namespace, tokens, 0, match.length))
        self.cache.inc_lock_ref(match.last_node)
        self.pool.req_to_token[row, :match.length] = match.indices.to(torch.int32)
        req.prefix_indices, req.last_node, req.num_computed = match.indices, match.last_node, match.length
        self.running.append(req)

    def compute(self, choices) -> None:
        """The next chunk of a running request; inserted before its KV is written, as the scheduler does."""
        if not self.running:
            return
        req = choices.choice(self.running)
        left = len(req.tokens) - req.num_computed
        if left == 0:
            return
        n = min(left, choices.integer(1, 3 * self.page_size))
        own = req.num_computed > len(req.prefix_indices)
        row = self.pool.req_to_token[req.req_pool_idx]
        last = int(row[req.num_computed - 1]) if own else -1
        slots = self.allocator.alloc_extend([last], [n])
        if slots is None:
            self.cache.evict(n + self.page_size)
            slots = self.allocator.alloc_extend([last], [n])
            if slots is None:
                return
        start = req.num_computed
        row[start:start + n] = slots.to(torch.int32)
        req.num_computed += n
        self.cache.cache_unfinished_req(req, req.tokens[:req.num_computed])
        own_slots = row[len(req.prefix_indices):req.num_computed].to(torch.int64)
        self.write(own_slots, req, len(req.prefix_indices))  # the batch runs: only slots still its own change
        if start < len(req.prefix_indices):
            shared = row[start:len(req.prefix_indices)].to(torch.int64)
            self.write(shared, req, start)  # the tree's copy of tokens computed in this batch, same KV

    def finish(self, choices) -> None:
        """Finish, abort or retract: whatever the request computed goes through the cache."""
        if not self.running:
            return
        req = self.running.pop(choices.integer(0, len(self.running) - 1))
        self.cache.cache_finished_req(req, req.tokens[:req.num_computed])
        self.pool.free(req.req_pool_idx)

    def match(self, choices) -> None:
        namespace, tokens = self.draw_target(choices)
        match = self.cache.match_prefix(tokens, namespace)
        assert torch.equal(self.device_block(match.indices), self.expected(namespace, tokens, 0, match.length))

    def evict(self, choices) -> None:
        before = self.allocator.available_size()
        evictable = self.cache.evictable_size()
        want = choices.integer(0, 12) * self.page_size
        freed = self.cache.evict(want)
        assert self.allocator.available_size() == before + freed
        assert freed >= want or self.cache.evictable_size() == 0
        assert self.cache.evictable_size() == evictable - freed

    def flush(self, choices) -> None:
        if self.running or choices.integer(0, 5):
            return
        self.cache.reset()
        assert self.allocator.available_size() == self.allocator.size
        assert self.host.available_size() == self.host.size
        assert self.cache.disk is None or self.cache.disk.used == 0

    # ---- checks ------------------------------------------------------------------------------------
    def check(self) -> None:
        ps, cache = self.page_size, self.cache
        held = []
        for req in self.running:
            own = self.pool.req_to_token[req.req_pool_idx, len(req.prefix_indices):req.num_computed].to(torch.int64)
            held += (own // ps).unique().tolist()
            row = self.pool.req_to_token[req.req_pool_idx, :req.num_computed].to(torch.int64)
            assert torch.equal(self.device_block(row), self.expected(req.namespace, req.tokens, 0, req.num_computed))
        cache.check_invariants(held_slots=len(held) * ps)
        device_pages, host_pages = list(held), []
        stack = [(node, []) for node in cache.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            tokens = prefix + node.key
            stack.extend((child, tokens) for child in node.children.values())
            if not node.key:
                continue
            want = self.expected(node.namespace, tokens, len(prefix), len(tokens))
            if node.value is not None:
                device_pages += (node.value // ps).unique().tolist()
                assert torch.equal(self.device_block(node.value), want), f"device KV of {node!r}"
            if node.host_value is not None:
                host_pages += (node.host_value // ps).unique().tolist()
                assert torch.equal(self.host.read(node.host_value), want), f"host KV of {node!r}"
            if node.disk is not None:
                assert torch.equal(cache.disk.get(node.disk, len(node.key)), want), f"disk KV of {node!r}"
        device_pages += (cache.quarantined_slots() // ps).unique().tolist()
        self.allocator.available_size()
        device_pages += self.allocator.free_page_list()
        assert sorted(device_pages) == list(range(1, self.allocator.num_pages + 1)), "device page owners"
        self.host.available_size()
        host_pages += self.host.allocator.free_page_list()
        assert sorted(host_pages) == list(range(1, self.host.allocator.num_pages + 1)), "host page owners"


OPERATIONS = ("admit", "compute", "finish", "match", "evict", "flush")
CONFIGS = {
    "page1-disk": dict(page_size=1),
    "page4-disk-write_back": dict(page_size=4, write_policy="write_back"),
    "page1-host-only": dict(page_size=1, disk_pages=None, use_disk=False),
    "page2-small-host": dict(page_size=2, host_pages=6, disk_pages=10),
}


def make_harness(tmp_dir: str, use_disk: bool = True, **config) -> Harness:
    return Harness(tmp_dir if use_disk else None, **config)


def machine_test(name: str):
    config = CONFIGS[name]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            import tempfile

            self.tmp = tempfile.TemporaryDirectory()
            self.harness = make_harness(self.tmp.name, **config)

        def teardown(self) -> None:
            self.harness.cache.close()
            self.tmp.cleanup()

        @invariant()
        def consistent(self) -> None:
            self.harness.check()

    for operation in OPERATIONS:
        def apply(self, data, operation=operation):
            getattr(self.harness, operation)(Choices(data))
        setattr(Machine, operation, rule(data=st.data())(apply))
    Machine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=list(HealthCheck))
    return Machine.TestCase


TestHiCachePage1Disk = machine_test("page1-disk")
TestHiCachePage4WriteBack = machine_test("page4-disk-write_back")
TestHiCacheHostOnly = machine_test("page1-host-only")
TestHiCacheSmallHost = machine_test("page2-small-host")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_long_random_walk(name, tmp_path):
    """Thousands of steps: deep trees, every tier full, nodes moving down and back up many times."""
    harness = make_harness(str(tmp_path), **CONFIGS[name])
    choices = Choices(seed=len(name))
    weights = (4, 8, 3, 2, 1, 0.2)
    for _ in range(700):
        getattr(harness, choices.rng.choices(OPERATIONS, weights)[0])(choices)
        harness.check()
    counters = harness.cache.lower_tiers().counters
    assert counters.backed_up_tokens > 0 and counters.loaded_from_host_tokens > 0
    if harness.cache.disk is not None:
        assert counters.written_to_disk_tokens > 0 and counters.loaded_from_disk_tokens > 0
    harness.cache.close()
