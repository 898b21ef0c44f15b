"""The radix tree against a plain reference model, plus targeted tests of eviction order, locking and namespaces.

The reference model is, per namespace, a dict from every cached page-aligned token prefix (a tuple) to the KV
slots of its last page: exactly "the set of inserted sequences", cut into whole pages, with the slots each page got
when first inserted. Which prefixes an eviction removed is observed independently, from the pages the allocator
got back.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.stats import MAX_NAMESPACES
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.tree import RadixCache

# Distinct tuples whose naive string concatenations would collide.
NAMESPACES = [(), ("a",), ("a", "b"), ("a|b",), ("ab",), ("b",)]
TOKENS = st.integers(0, 2)  # a tiny alphabet, so sequences share prefixes and nodes split often


def make_cache(size: int, page_size: int = 1, policy: str = "lru") -> RadixCache:
    return RadixCache(ReqToTokenPool(2, 8), KVAllocator(size, page_size), page_size, policy)


def free_pages(allocator: KVAllocator) -> list[int]:
    allocator.available_size()  # applies batched frees
    return allocator.free_page_list()


def path_tokens(node) -> list[int]:
    """The tokens on the path from the namespace root down to `node`."""
    parts = []
    while node.key:
        parts.append(node.key)
        node = node.parent
    return [token for part in reversed(parts) for token in part]


class HypothesisChoices:
    """Choices drawn by Hypothesis (shrinkable)."""

    def __init__(self, data) -> None:
        self.data = data

    def integer(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high))

    def choice(self, options: list):
        return self.data.draw(st.sampled_from(options))


class RandomChoices:
    """Choices from a seeded generator, for long random walks that grow larger trees."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options: list):
        return self.rng.choice(options)


class ReferenceHarness:
    """A RadixCache driven next to the reference model; every operation checks its result against the model."""

    def __init__(self, page_size: int, policy: str = "lru", num_pages: int = 48) -> None:
        self.page_size = page_size
        self.allocator = KVAllocator(num_pages * page_size, page_size)
        self.cache = RadixCache(ReqToTokenPool(1, 8), self.allocator, page_size, policy)
        self.ref: dict[tuple, dict[tuple, list[int]]] = {namespace: {} for namespace in NAMESPACES}
        self.history: list[tuple] = []  # recent (namespace, tokens) inserted, to derive related sequences
        self.locks: list[tuple] = []  # (node, namespace, matched tokens, slots)
        self.expected_stats = {ns: dict.fromkeys(("queried", "matched", "inserted", "evicted"), 0) for ns in NAMESPACES}

    # ---- generation ------------------------------------------------------------------------------------
    def draw_target(self, choices) -> tuple[tuple, list[int]]:
        """A namespace and a sequence; mostly a cut of an earlier one plus a short tail, so that tries overlap."""
        # Hypothesis leans towards small draws, so the common outcomes are put on the large values.
        if self.history and choices.integer(0, 3) > 0:
            namespace, base = choices.choice(self.history)
            if choices.integer(0, 4) == 4:
                namespace = choices.choice(NAMESPACES)  # the same tokens elsewhere must not match
            cut = len(base) - choices.integer(0, len(base))
            return namespace, base[:cut] + self.draw_tokens(choices, max_pages=2)
        return choices.choice(NAMESPACES), self.draw_tokens(choices, max_pages=5)

    def draw_tokens(self, choices, max_pages: int) -> list[int]:
        """Whole pages of one repeated token (so pages recur), maybe one token changed (so a match can end
        inside a page), then a tail shorter than a page."""
        page_size = self.page_size
        units = [choices.integer(0, 2) for _ in range(choices.integer(0, max_pages))]
        tokens = [unit for unit in units for _ in range(page_size)]
        if tokens and choices.integer(0, 1):
            tokens[choices.integer(0, len(tokens) - 1)] = choices.integer(0, 2)
        return tokens + [choices.integer(0, 2) for _ in range(choices.integer(0, page_size - 1))]

    # ---- the reference model ---------------------------------------------------------------------------
    def expected_match(self, namespace: tuple, seq: list[int]) -> int:
        ref = self.ref[namespace]
        length = len(seq) - len(seq) % self.page_size
        while length and tuple(seq[:length]) not in ref:
            length -= self.page_size
        return length

    def ref_slots(self, namespace: tuple, tokens) -> list:
        """The reference's slots for the page-aligned `tokens` (None for pages it does not hold)."""
        page_size, ref = self.page_size, self.ref[namespace]
        pages = [ref.get(tuple(tokens[:end]), [None] * page_size) for end in range(page_size, len(tokens) + 1, page_size)]
        return [slot for page in pages for slot in page]

    def check_match(self, namespace: tuple, seq: list[int]):
        result = self.cache.match_prefix(seq, namespace)
        expected = self.expected_match(namespace, seq)
        assert result.length == expected
        assert result.indices.tolist() == self.ref_slots(namespace, seq[:expected])
        assert path_tokens(result.last_node) == seq[:expected]
        if expected:
            assert result.last_node.namespace == namespace
        self.expected_stats[namespace]["queried"] += len(seq)
        self.expected_stats[namespace]["matched"] += expected
        return result

    def evict_and_check(self, num_tokens: int) -> int:
        cache, page_size = self.cache, self.page_size
        before = set(free_pages(self.allocator))
        total_before, evictable_before = cache.total_size(), cache.evictable_size()
        freed = cache.evict(num_tokens)
        newly_free = set(free_pages(self.allocator)) - before
        assert len(newly_free) * page_size == freed == total_before - cache.total_size()
        assert freed <= evictable_before
        assert freed >= num_tokens or cache.evictable_size() == 0
        removed = 0
        for namespace, ref in self.ref.items():
            gone = [prefix for prefix, slots in ref.items() if slots[0] // page_size in newly_free]
            for prefix in gone:
                del ref[prefix]
            removed += len(gone) * page_size
            self.expected_stats[namespace]["evicted"] += len(gone) * page_size
            # Eviction removes leaves only, so what remains is still closed under prefixes.
            assert all(prefix[:-page_size] in ref for prefix in ref if len(prefix) > page_size)
        assert removed == freed, "eviction freed slots the tree did not hold"
        return freed

    # ---- operations ------------------------------------------------------------------------------------
    def insert(self, choices) -> None:
        namespace, seq = self.draw_target(choices)
        self.history = (self.history + [(namespace, seq)])[-20:]
        slots = self.allocator.alloc(len(seq))
        if slots is None:
            self.evict_and_check(len(seq) + self.page_size)
            slots = self.allocator.alloc(len(seq))
            if slots is None:
                return  # everything left is locked
        num_aligned = len(seq) - len(seq) % self.page_size
        expected_present = self.expected_match(namespace, seq)
        present = self.cache.insert(seq, slots, namespace)
        assert present == expected_present
        ref = self.ref[namespace]
        for end in range(present + self.page_size, num_aligned + 1, self.page_size):
            ref[tuple(seq[:end])] = slots[end - self.page_size:end].tolist()
        self.expected_stats[namespace]["inserted"] += num_aligned - present
        # The caller frees its copies of tokens that were present and the unaligned tail.
        self.allocator.free(torch.cat([slots[:present], slots[num_aligned:]]))

    def match(self, choices) -> None:
        self.check_match(*self.draw_target(choices))

    def lock(self, choices) -> None:
        namespace, seq = self.draw_target(choices)
        result = self.check_match(namespace, seq)
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        delta = self.cache.inc_lock_ref(result.last_node)
        assert delta <= 0 and self.cache.evictable_size() == evictable + delta
        assert self.cache.protected_size() == protected - delta
        self.locks.append((result.last_node, namespace, tuple(seq[:result.length]), result.indices.tolist()))

    def unlock(self, choices) -> None:
        if not self.locks:
            return
        node = self.locks.pop(choices.integer(0, len(self.locks) - 1))[0]
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        delta = self.cache.dec_lock_ref(node)
        assert delta >= 0 and self.cache.evictable_size() == evictable + delta
        assert self.cache.protected_size() == protected - delta

    def evict(self, choices) -> None:
        self.evict_and_check(choices.integer(0, 24) * self.page_size)

    def flush(self, choices) -> None:
        if choices.integer(0, 7):
            return  # rarely: a flush wipes the state the other operations build up
        if any(tokens for _node, _namespace, tokens, _slots in self.locks):
            total = self.cache.total_size()
            with pytest.raises(RuntimeError):
                self.cache.reset()
            assert self.cache.total_size() == total
            return
        self.cache.reset()
        for ref in self.ref.values():
            ref.clear()
        assert self.allocator.available_size() == self.allocator.size

    # ---- checks after every step -----------------------------------------------------------------------
    def check(self) -> None:
        cache, page_size = self.cache, self.page_size
        cache.check_invariants(held_slots=0)
        free = free_pages(self.allocator)
        assert len(free) == len(set(free)), "a page was freed twice"
        cached = [slots[0] // page_size for ref in self.ref.values() for slots in ref.values()]
        assert not set(free) & set(cached), "a cached slot is also free"
        assert sum(len(ref) for ref in self.ref.values()) * page_size == cache.total_size()
        locked = set()
        for _node, namespace, tokens, slots in self.locks:
            assert self.ref_slots(namespace, tokens) == slots, "a locked prefix changed"
            locked.update((namespace, tokens[:end]) for end in range(page_size, len(tokens) + 1, page_size))
        assert cache.protected_size() == len(locked) * page_size
        stats = cache.stats()["namespaces"]
        for namespace, expected in self.expected_stats.items():
            got = stats.get(namespace, {})
            assert [got.get(f"{name}_tokens", 0) for name in expected] == list(expected.values())


OPERATIONS = ("insert", "match", "lock", "unlock", "evict", "flush")


class RadixCacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.harness = ReferenceHarness(self.PAGE_SIZE, self.POLICY)

    @rule(data=st.data())
    def insert(self, data):
        self.harness.insert(HypothesisChoices(data))

    @rule(data=st.data())
    def match(self, data):
        self.harness.match(HypothesisChoices(data))

    @rule(data=st.data())
    def lock(self, data):
        self.harness.lock(HypothesisChoices(data))

    @precondition(lambda self: self.harness.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.harness.unlock(HypothesisChoices(data))

    @rule(data=st.data())
    def evict(self, data):
        self.harness.evict(HypothesisChoices(data))

    @rule(data=st.data())
    def flush(self, data):
        self.harness.flush(HypothesisChoices(data))

    @invariant()
    def consistent(self):
        self.harness.check()


def machine_test(page_size: int, policy: str = "lru"):
    machine = type(f"Machine{page_size}{policy}", (RadixCacheMachine,), {"PAGE_SIZE": page_size, "POLICY": policy})
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
    )
    return machine.TestCase


TestStatefulPage1 = machine_test(1)
TestStatefulPage4 = machine_test(4)
TestStatefulPage16 = machine_test(16)
TestStatefulPage4Lfu = machine_test(4, "lfu")


@pytest.mark.parametrize("page_size, policy", [(1, "lru"), (4, "lfu"), (16, "lru")])
def test_long_random_walk(page_size, policy):
    """Thousands of steps over a larger pool: deep trees, many splits, evictions under memory pressure."""
    harness = ReferenceHarness(page_size, policy, num_pages=160)
    choices = RandomChoices(seed=page_size)
    weights = (8, 6, 3, 3, 1, 1)  # mostly inserts and matches, so the tree grows
    for _ in range(3000):
        operation = choices.rng.choices(OPERATIONS, weights)[0]
        getattr(harness, operation)(choices)
        harness.check()
    assert harness.cache.stats()["matched_tokens"] > 0


# ---- targeted tests ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.lists(TOKENS, max_size=80), st.lists(TOKENS, max_size=80), st.integers(0, 20))
def test_common_prefix_length_matches_naive(key, query, start):
    start = min(start, len(query))
    naive = 0
    while naive < len(key) and start + naive < len(query) and key[naive] == query[start + naive]:
        naive += 1
    assert common_prefix_length(key, query, start, len(query)) == naive


def insert_fresh(cache: RadixCache, tokens: list[int], namespace: tuple = ()) -> int:
    slots = cache.allocator.alloc(len(tokens))
    present = cache.insert(tokens, slots, namespace)
    cache.allocator.free(slots[:present])
    return present


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_order(policy):
    cache = make_cache(64, policy=policy)
    for first in (1, 2, 3):
        insert_fresh(cache, [first] * 4)
    for _ in range(3):
        cache.match_prefix([1] * 4)  # 1 is used most often but longest ago
    cache.match_prefix([2] * 4)
    cache.match_prefix([3] * 4)  # 3 is the most recent
    assert cache.evict(4) == 4
    remaining = {first for first in (1, 2, 3) if cache.match_prefix([first] * 4).length}
    assert remaining == ({2, 3} if policy == "lru" else {1, 3})
    cache.check_invariants()


def test_evict_skips_locked_and_cascades_to_parents():
    cache = make_cache(64)
    insert_fresh(cache, [1, 1, 1, 1])
    insert_fresh(cache, [1, 1, 2, 2])  # splits: [1,1] -> {[1,1], [2,2]}
    insert_fresh(cache, [5, 5])
    locked = cache.match_prefix([5, 5])
    cache.inc_lock_ref(locked.last_node)
    assert cache.evict(100) == 6  # both leaves, then their parent; never the locked [5,5]
    assert cache.total_size() == cache.protected_size() == 2
    cache.check_invariants()
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(locked.last_node)
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size
    cache.check_invariants()


def test_split_keeps_a_held_lock_on_the_whole_path():
    cache = make_cache(64)
    insert_fresh(cache, [1, 2, 3, 4])
    held = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(held.last_node)
    cache.match_prefix([1, 2, 9])  # splits the locked node after two tokens
    assert cache.evict(100) == 0
    assert cache.dec_lock_ref(held.last_node) == 4
    assert cache.evict(100) == 4
    cache.check_invariants()


def test_namespaces_never_share():
    cache = make_cache(64)
    insert_fresh(cache, [1, 2, 3], ("tenant", "salt"))
    for other in [(), ("tenant",), ("tenant|salt",), ("tenantsalt",), ("salt", "tenant")]:
        assert cache.match_prefix([1, 2, 3], other).length == 0
        assert insert_fresh(cache, [1, 2, 3], other) == 0
    assert cache.match_prefix([1, 2, 3], ("tenant", "salt")).length == 3
    with pytest.raises(TypeError):
        cache.match_prefix([1, 2, 3], "tenant|salt")
    cache.check_invariants()


def test_page_size_truncates_and_matches_whole_pages_only():
    cache = make_cache(64, page_size=4)
    slots = cache.allocator.alloc(10)
    assert cache.insert(list(range(10)), slots) == 0
    cache.allocator.free(slots[8:])  # the unaligned tail stays the caller's
    assert cache.total_size() == 8
    assert cache.match_prefix(list(range(7))).length == 4
    assert cache.match_prefix(list(range(3))).length == 0
    result = cache.match_prefix(list(range(10)))
    assert result.length == 8 and result.indices.tolist() == slots[:8].tolist()
    cache.check_invariants()


def test_invariant_check_catches_corruption():
    cache = make_cache(64)
    insert_fresh(cache, [1, 2, 3])
    cache.allocator.free(cache.match_prefix([1, 2, 3]).indices[:1])  # a double owner of one slot
    with pytest.raises(AssertionError, match="slot accounting"):
        cache.check_invariants()


def test_stats_per_namespace():
    cache = make_cache(64)
    insert_fresh(cache, [1, 2, 3, 4], ("t1",))
    cache.match_prefix([1, 2, 9, 9], ("t1",))
    cache.match_prefix([1, 2], ("t2",))
    cache.evict(100)
    stats = cache.stats()
    assert stats["namespaces"][("t1",)] == {
        "queried_tokens": 4, "matched_tokens": 2, "inserted_tokens": 4, "evicted_tokens": 4, "hit_rate": 0.5,
    }
    assert stats["namespaces"][("t2",)]["queried_tokens"] == 2
    assert stats["queried_tokens"] == 6 and stats["matched_tokens"] == 2


def test_stats_keep_a_bounded_number_of_namespaces():
    cache = make_cache(64)
    assert cache.stats()["dropped_namespaces"] == 0
    extra = 100
    for salt in range(MAX_NAMESPACES + extra):
        cache.match_prefix([1, 2, 3], ("tenant", f"salt-{salt}"))
    cache.match_prefix([1], ("tenant", "salt-0"))  # dropped long ago: starts again from zero
    stats = cache.stats()
    namespaces = stats["namespaces"]
    assert len(namespaces) == MAX_NAMESPACES
    assert namespaces[("tenant", "salt-0")]["queried_tokens"] == 1
    assert ("tenant", f"salt-{extra}") not in namespaces  # the least recently used went
    assert ("tenant", f"salt-{MAX_NAMESPACES + extra - 1}") in namespaces
    assert stats["dropped_namespaces"] == extra + 1
    assert stats["queried_tokens"] == 3 * (MAX_NAMESPACES + extra) + 1  # the totals still count everything
