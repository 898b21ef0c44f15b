"""Retained sessions (radix_cache/retention.py): a session's prefix outlives eviction until it expires, within its
tenant's quota; a tenant never releases, extends or reads another's session; without retention the cache is plain
LRU. First on the tree with a hand-driven clock (device-only, then with a host tier, where a session is kept on the
host and leaves the device to running requests), then through a real scheduler under KV pressure."""

from __future__ import annotations

import random

import pytest

from scheduler_driver import SchedulerDriver

import torch

from radixserve.radix_cache.hiradix import HiRadixCache
from radixserve.radix_cache.host_pool import HostKVPool
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.radix_cache.retention import RetainedSessions
from radixserve.radix_cache.tree import RadixCache
from radixserve.runtime.wire.messages import SessionRetention
from radixserve.runtime.wire.request import GenerateRequest, RequestFieldError, normalize

A, B = ("tenant:alpha",), ("tenant:beta",)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached(cache: RadixCache, tokens: list[int], namespace: tuple) -> None:
    slots = cache.allocator.alloc(len(tokens))
    present = cache.insert(tokens, slots, namespace)
    cache.allocator.free(slots[:present])


def setup(size: int = 64, tenant_quota: int = 20, total_quota: int = 32):
    clock = Clock()
    cache = RadixCache(ReqToTokenPool(2, 8), KVAllocator(size, 1), 1)
    return cache, RetainedSessions(cache, tenant_quota, total_quota, clock), clock


def check(cache: RadixCache, sessions: RetainedSessions) -> None:
    cache.check_invariants()
    assert cache.protected_size() == sessions.retained_size()


def test_retained_prefix_survives_eviction_until_it_expires():
    cache, sessions, clock = setup()
    cached(cache, list(range(1, 11)), A)
    cached(cache, list(range(100, 110)), A)
    assert sessions.retain(A, "chat-1", list(range(1, 11)), seconds=30.0) == 10
    check(cache, sessions)
    assert cache.evict(10**6) == 10  # only the other prefix goes
    assert cache.match_prefix(list(range(1, 11)), A).length == 10
    clock.now = 29.0
    assert sessions.expire() == 0
    clock.now = 30.0
    assert sessions.expire() == 1 and len(sessions) == 0
    check(cache, sessions)
    assert cache.evict(10**6) == 10 and cache.total_size() == 0


def test_a_later_turn_moves_the_retention_to_its_longer_prefix_and_renews_it():
    cache, sessions, clock = setup()
    turn1 = list(range(1, 9))
    turn2 = turn1 + list(range(50, 56))
    cached(cache, turn1, A)
    sessions.retain(A, "s", turn1, seconds=10.0)
    clock.now = 8.0
    cached(cache, turn2, A)
    assert sessions.retain(A, "s", turn2, seconds=10.0) == len(turn2)
    assert len(sessions) == 1 and cache.protected_size() == len(turn2)
    clock.now = 12.0  # past the first turn's expiry, within the second's
    assert sessions.expire() == 0
    assert cache.evict(10**6) == 0
    check(cache, sessions)


def test_a_tenant_never_releases_or_extends_another_tenants_session():
    cache, sessions, _ = setup()
    prompt = list(range(1, 9))
    cached(cache, prompt, A)
    sessions.retain(A, "shared-key", prompt, seconds=60.0)
    # The same key under tenant B is B's own session: it finds nothing of A's prefix and touches nothing of A's.
    assert sessions.retain(B, "shared-key", prompt, seconds=60.0) == 0
    assert len(sessions) == 1 and cache.protected_size() == len(prompt)
    assert sessions.stats().tokens_by_tenant == {"alpha": len(prompt)}
    cache.evict(10**6)
    assert cache.match_prefix(prompt, A).length == len(prompt)
    assert cache.match_prefix(prompt, B).length == 0
    check(cache, sessions)


def test_quota_displaces_the_same_tenants_soonest_expiring_session_only():
    cache, sessions, _ = setup(size=96, tenant_quota=20, total_quota=40)
    prompts = {name: [base + i for i in range(8)] for name, base in (("a1", 100), ("a2", 200), ("a3", 300),
                                                                      ("b1", 400))}
    for name, prompt in prompts.items():
        cached(cache, prompt, B if name.startswith("b") else A)
    assert sessions.retain(B, "b1", prompts["b1"], seconds=1.0) == 8  # expires first of all
    assert sessions.retain(A, "a1", prompts["a1"], seconds=50.0) == 8
    assert sessions.retain(A, "a2", prompts["a2"], seconds=100.0) == 8
    assert sessions.retain(A, "a3", prompts["a3"], seconds=200.0) == 8  # 24 > 20: a1 goes, not b1
    stats = sessions.stats()
    assert stats.tokens_by_tenant == {"alpha": 16, "beta": 8} and stats.displaced_sessions == 1
    check(cache, sessions)
    long_prompt = list(range(500, 525))
    cached(cache, long_prompt, A)
    assert sessions.retain(A, "long", long_prompt, seconds=10.0) == 0  # longer than the quota alone
    assert sessions.stats().refused_sessions == 1 and sessions.stats().tokens_by_tenant["alpha"] == 16
    check(cache, sessions)


def test_the_total_quota_never_releases_another_tenants_session():
    cache, sessions, _ = setup(size=96, tenant_quota=20, total_quota=24)
    a, b = list(range(100, 116)), list(range(200, 216))
    cached(cache, a, A)
    cached(cache, b, B)
    assert sessions.retain(A, "a", a, seconds=1.0) == 16
    assert sessions.retain(B, "b", b, seconds=100.0) == 0  # 32 > 24: refused, A's session stays
    assert sessions.stats().tokens_by_tenant == {"alpha": 16} and sessions.stats().refused_sessions == 1
    check(cache, sessions)


def test_random_sessions_keep_the_accounting():
    cache, sessions, clock = setup(size=400, tenant_quota=60, total_quota=100)
    rng = random.Random(0)
    for step in range(300):
        namespace = rng.choice([A, B, ()])
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
        if cache.allocator.available_size() < len(prompt):
            cache.evict(len(prompt))
        if cache.allocator.available_size() >= len(prompt):
            cached(cache, prompt, namespace)
        if rng.random() < 0.6:
            sessions.retain(namespace, f"s{rng.randrange(6)}", prompt, seconds=rng.uniform(1, 20))
        clock.now += rng.uniform(0, 2)
        sessions.expire()
        check(cache, sessions)
        used = sessions.stats().tokens_by_tenant
        assert all(tokens <= 60 for tokens in used.values()) and sum(used.values()) <= 100
    sessions.release_all()
    check(cache, sessions)
    assert cache.protected_size() == 0


def hi_setup(device: int = 40, host: int = 48, tenant_quota: int = 20, total_quota: int = 24):
    clock = Clock()
    kv = TokenToKVPool(device, 1, 1, 1, 2, torch.float32)
    cache = HiRadixCache(ReqToTokenPool(2, 8), KVAllocator(device, 1), HostKVPool(kv, host), 1)
    return cache, RetainedSessions(cache, tenant_quota, total_quota, clock), clock


def fill(cache: HiRadixCache, tokens: list[int], namespace: tuple) -> None:
    """Insert `tokens` as a finished request would, evicting (demoting) first when the device is short."""
    if cache.allocator.available_size() < len(tokens):
        cache.evict(len(tokens) - cache.allocator.available_size())
    cached(cache, tokens, namespace)


def test_with_a_host_tier_a_session_is_kept_on_the_host_not_the_device():
    cache, sessions, clock = hi_setup()
    session = list(range(1, 17))
    fill(cache, session, A)
    assert sessions.retain(A, "chat-1", session, seconds=30.0) == 16
    cache.check_invariants()
    assert cache.protected_size() == 0 and sessions.retained_size() == 0  # the device stays the requests'
    # Other traffic, several times the device and the host: the session is demoted, never dropped.
    for i in range(12):
        fill(cache, [1000 + 20 * i + j for j in range(16)], B)
        cache.check_invariants()
    match = cache.match_prefix(session, A)
    assert match.length + match.host_hit_length == 16
    assert match.length < 16  # some of it left the device (to the host, not away)
    loaded = cache.load_back(match)
    assert loaded.length == 16
    cache.check_invariants()
    # Expired, it is host-evictable like any other entry: enough traffic drops it.
    clock.now = 31.0
    assert sessions.expire() == 1
    for i in range(12):
        fill(cache, [5000 + 20 * i + j for j in range(16)], B)
    cache.check_invariants()
    match = cache.match_prefix(session, A)
    assert match.length + match.host_hit_length == 0


def test_without_retention_the_host_tier_loses_the_prefix_to_the_same_traffic():
    cache, _, _ = hi_setup()
    session = list(range(1, 17))
    fill(cache, session, A)
    for i in range(12):
        fill(cache, [1000 + 20 * i + j for j in range(16)], B)
    match = cache.match_prefix(session, A)
    assert match.length + match.host_hit_length == 0


def test_host_retention_refuses_what_the_host_cannot_hold_and_keeps_the_accounting():
    cache, sessions, clock = hi_setup(device=64, host=24, tenant_quota=64, total_quota=64)
    first, second = list(range(1, 17)), list(range(100, 116))
    fill(cache, first, A)
    fill(cache, second, B)
    assert sessions.retain(A, "a", first, seconds=10.0) == 16
    assert sessions.retain(B, "b", second, seconds=10.0) == 0  # 16 pinned + 16 > 24 host slots
    cache.check_invariants()
    rng = random.Random(2)
    for step in range(300):
        namespace = rng.choice([A, B, ()])
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
        fill(cache, prompt, namespace)
        if rng.random() < 0.5:
            sessions.retain(namespace, f"s{rng.randrange(4)}", prompt, seconds=rng.uniform(1, 20))
        if rng.random() < 0.2:
            match = cache.match_prefix(prompt, namespace)
            cache.load_back(match)
        clock.now += rng.uniform(0, 2)
        sessions.expire()
        cache.check_invariants()
        assert cache.protected_size() == 0
    sessions.release_all()
    cache.check_invariants()


def test_generate_request_retention_fields():
    from radixserve.runtime.wire.messages import ModelInfo

    model = ModelInfo(context_len=100, vocab_size=100, max_total_num_tokens=1000, max_running_requests=8,
                      page_size=1, eos_token_ids=[0], model_path=None, device="cpu", dtype="float32",
                      attention_backend="torch_native", chunked_prefill_size=None, schedule_policy="fcfs",
                      overlap_schedule=False, radix_cache=True, sampling_defaults={}, dp_size=1)
    request = GenerateRequest(input_ids=[1, 2, 3], prompt_cache_key="chat-1", prompt_cache_retention=300.0,
                              tenant="alpha")
    options = normalize(request, model).prompts[0].options
    assert options.retention == SessionRetention("chat-1", 300.0) and options.namespace == A
    assert normalize(GenerateRequest(input_ids=[1], prompt_cache_key="k"), model).prompts[0].options.retention is None
    with pytest.raises(RequestFieldError) as error:
        normalize(GenerateRequest(input_ids=[1], prompt_cache_retention=5.0), model)
    assert error.value.field == "prompt_cache_key"
    with pytest.raises(RequestFieldError):
        normalize(GenerateRequest(input_ids=[1], prompt_cache_key="k", prompt_cache_retention=-1.0), model)


@pytest.mark.parametrize("retain,hicache", [(True, False), (False, False), (True, True), (False, True)])
def test_scheduler_keeps_a_retained_session_under_kv_pressure(tiny_model_dir, retain, hicache):
    """A session's turn, then other traffic that fills the pool several times over, then the session's next turn:
    with retention the whole first turn (prompt and output) is read from the cache; with plain LRU it is gone. With
    the host tier (twice the device pool, also overrun by the traffic) the session waits on the host, holding no
    device room, and its next turn loads it back."""
    tiers = dict(enable_hierarchical_cache=True, hicache_ratio=2.0) if hicache else {}
    driver = SchedulerDriver(tiny_model_dir("llama"), max_total_tokens=512, retention_quota_tokens=200, **tiers)
    rng = random.Random(1)
    turn1 = [rng.randrange(3, 200) for _ in range(120)]
    retention = SessionRetention("agent-1", 600.0) if retain else None
    driver.submit("turn1", turn1, namespace=A, retention=retention, max_new_tokens=8)
    driver.run_until_idle()
    output = driver.results["turn1"].output_ids
    for i in range(20):  # 20 x 100 prompt tokens through a 512-token pool (and a 1,024-token host tier)
        driver.submit(f"other-{i}", [rng.randrange(3, 200) for _ in range(100)], namespace=B, max_new_tokens=4)
        driver.run_until_idle()
    turn2 = turn1 + output + [rng.randrange(3, 200) for _ in range(20)]
    driver.submit("turn2", turn2, namespace=A, retention=retention, max_new_tokens=4)
    driver.run_until_idle()
    cached_tokens = driver.results["turn2"].cached_tokens
    if retain:
        # The first turn's KV, up to its last sampled token (whose KV was never computed).
        assert cached_tokens >= len(turn1) + len(output) - 1
        assert driver.scheduler.retention.stats().retained_sessions == 1
        if hicache:
            assert driver.scheduler.cache.lower_tiers().counters.loaded_from_host_tokens >= len(turn1)
    else:
        assert cached_tokens == 0
    driver.close()
