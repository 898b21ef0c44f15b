"""The hierarchical cache of hybrid models (radix_cache/hybrid_hiradix.py): state snapshots move to the host with their
node's KV and come back on a hit.

- on real pools without a model: a snapshot demoted with its KV lands on the host bit for bit, a match finds it
  there, and `load_back` restores it into a device snapshot slot, bit for bit; every step passes `check_invariants`
  (both caches' rules and every slot of both state pools free or held by exactly one node);
- through a real scheduler on the tiny Qwen3.5: a multi-turn workload whose working set is larger than the device KV
  pool gets hits on the host tier (KV and snapshots loaded back), caches more than the one-tier radix cache on the
  same pool, and answers exactly as with the cache off; after the flush no slot of either tier is held.
"""

from __future__ import annotations

import pytest
import torch

from scheduler_driver import SchedulerDriver
from test_hybrid_cache import multi_turn
from test_hybrid_radix_cache import ROWS, admit, finish

from radixserve.radix_cache.host_pool import HostKVPool
from radixserve.radix_cache.hybrid import NO_SNAPSHOT
from radixserve.radix_cache.hybrid_hiradix import HybridHiRadixCache
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.radix_cache.state_pool import HostStatePool, StatePool
from radixserve.runtime.wire.sampling_params import SamplingParams
from radixserve.scheduler.req import Req


def make_cache(device_tokens: int = 64, snapshots: int = 4, host_snapshots: int = 4) -> HybridHiRadixCache:
    states = StatePool(ROWS, ROWS + snapshots, num_layers=2, conv_dim=3, conv_width=4, num_heads=2, key_dim=2,
                       value_dim=2, ssm_dtype=torch.float32, conv_dtype=torch.float32)
    kv = TokenToKVPool(device_tokens, 1, 2, 1, 2, torch.float32)
    return HybridHiRadixCache(ReqToTokenPool(ROWS, 64), KVAllocator(device_tokens), HostKVPool(kv, 4 * device_tokens),
                              states, HostStatePool(states, host_snapshots))


def fill_snapshot(cache: HybridHiRadixCache, slot: int, seed: int) -> list[torch.Tensor]:
    """Write distinct states into snapshot slot `slot` (what the batch computing it would do); returns them."""
    generator = torch.Generator().manual_seed(seed)
    pool = cache.state_pool
    states = [torch.randn(t.shape[1:], generator=generator) for t in pool.conv + pool.recurrent]
    for tensor, state in zip(pool.conv + pool.recurrent, states):
        tensor[slot] = state
    return states


def snapshot_of(cache: HybridHiRadixCache, slot: int) -> list[torch.Tensor]:
    pool = cache.state_pool
    return [t[slot].clone() for t in pool.conv + pool.recurrent]


def test_a_demoted_snapshot_comes_back_bit_for_bit():
    cache = make_cache()
    prompt = list(range(100, 140))
    req, _ = admit(cache, prompt)
    written = fill_snapshot(cache, req.pending_snapshot_before_last, seed=1)
    finish(cache, req)
    # Evicting every device token demotes the nodes: their KV and snapshots go to the host.
    assert cache.evict(cache.evictable_size()) >= len(prompt)
    cache.check_invariants()
    assert cache.num_snapshots() == 0 and cache.snapshots_backed_up >= 1
    assert cache.state_pool.available_snapshots() == cache.state_pool.num_snapshot_slots
    # The same prompt again: the match ends on the host, one token before the end, where the snapshot is.
    match = cache.match_prefix(prompt[:-1])
    assert match.length == 0 and match.host_hit_length == len(prompt) - 1
    loaded = cache.load_back(match)
    cache.check_invariants()
    assert loaded.length == len(prompt) - 1 and cache.snapshots_loaded == 1
    slot = cache.state_snapshot(loaded.last_node, loaded.length)
    assert slot != NO_SNAPSHOT
    for restored, original in zip(snapshot_of(cache, slot), written):
        assert torch.equal(restored, original)
    cache.reset()
    cache.check_invariants()
    assert cache.host_state_pool.available() == cache.host_state_pool.size


def test_host_snapshot_budget_and_drops_free_every_slot():
    """More demoted snapshots than host snapshot slots: the least recently used host snapshots go, the invariants
    hold at every step, and dropping the nodes (a flush) leaves every slot of both pools free."""
    cache = make_cache(device_tokens=48, host_snapshots=2)
    for i in range(6):
        req, _ = admit(cache, [1000 * (i + 1) + t for t in range(12)])
        finish(cache, req)
        cache.evict(cache.evictable_size())
        cache.check_invariants()
    assert cache.snapshots_backed_up > 2 and cache.host_state_pool.available() == 0
    cache.reset()
    cache.check_invariants()
    assert cache.host_state_pool.available() == 2
    assert cache.state_pool.available_snapshots() == cache.state_pool.num_snapshot_slots


def test_a_promotion_that_loses_its_host_copy_loads_nothing():
    """One host snapshot slot: bringing A's snapshot back needs a device slot, whose LRU victim (B's snapshot) moves
    to the host and takes the only host slot, A's. The match is then cut back; nothing stale is loaded."""
    cache = make_cache(snapshots=2, host_snapshots=1)
    first = list(range(200, 220))
    req, _ = admit(cache, first)
    fill_snapshot(cache, req.pending_snapshot_before_last, seed=2)
    finish(cache, req)
    cache.evict(cache.evictable_size())  # A's KV and its snapshot one token before the end go to the host
    cache.check_invariants()
    other, _ = admit(cache, list(range(500, 520)))  # B takes both device snapshot slots
    finish(cache, other)
    match = cache.match_prefix(first[:-1])
    assert match.host_hit_length == len(first) - 1
    loaded = cache.load_back(match)
    cache.check_invariants()
    assert loaded.length == 0 and cache.snapshots_loaded == 0
    assert cache.state_snapshot(loaded.last_node, loaded.length) == NO_SNAPSHOT


def test_a_retained_sessions_host_snapshot_is_kept():
    """A retained session's path is pinned on the host (docs/agents.md): with one host snapshot slot, held by that
    path, B's demoted snapshot finds no room rather than taking it, and A still resumes from the host."""
    cache = make_cache(snapshots=2, host_snapshots=1)
    first = list(range(300, 320))
    req, _ = admit(cache, first)
    finish(cache, req)
    cache.evict(cache.evictable_size())
    handle, _ = cache.retain_prefix(first)
    other, _ = admit(cache, list(range(600, 620)))
    finish(cache, other)
    backed_up = cache.snapshots_backed_up
    cache.evict(cache.evictable_size())
    cache.check_invariants()
    assert cache.snapshots_backed_up == backed_up  # no host slot for B's snapshot
    assert cache.match_prefix(first[:-1]).host_hit_length == len(first) - 1
    cache.release_prefix(handle)
    cache.reset()
    cache.check_invariants()


def expected_states(cache: HybridHiRadixCache, prefix: list[int]) -> list[torch.Tensor]:
    """The states a model would have after `prefix`: a function of the prefix alone, so any mix-up shows."""
    generator = torch.Generator().manual_seed(hash(tuple(prefix)) % (2 ** 31))
    pool = cache.state_pool
    return [torch.randn(t.shape[1:], generator=generator) for t in pool.conv + pool.recurrent]


def write_states(cache: HybridHiRadixCache, slot: int, prefix: list[int]) -> None:
    pool = cache.state_pool
    for tensor, state in zip(pool.conv + pool.recurrent, expected_states(cache, prefix)):
        tensor[slot] = state


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_resumes_from_the_right_states(seed):
    """Six conversations' prompts of random lengths admitted with the scheduler's steps (match, load back, lock,
    extend, the batch writing its states, finish) and random device evictions, on a device pool a fraction of the
    working set and few snapshot slots of either tier: every resume point holds exactly the states of its prefix
    (whichever tiers it went through), and the invariants hold after every step."""
    import random

    rng = random.Random(seed)
    cache = make_cache(device_tokens=96, snapshots=3, host_snapshots=5)
    streams = [[1000 * (c + 1) + t for t in range(60)] for c in range(6)]
    resumed = 0
    for _ in range(150):
        prompt = streams[rng.randrange(6)][:rng.randint(4, 60)]
        match = cache.load_back(cache.match_prefix(prompt[:-1]))
        cache.inc_lock_ref(match.last_node)
        req = Req(f"r{_}", prompt, SamplingParams(max_new_tokens=1))
        req.req_pool_idx = cache.req_to_token_pool.alloc()
        req.prefix_indices, req.last_node = match.indices, match.last_node
        if match.length:
            slot = cache.state_snapshot(match.last_node, match.length)
            assert slot != NO_SNAPSHOT
            for state, expected in zip(snapshot_of(cache, slot), expected_states(cache, prompt[:match.length])):
                assert torch.equal(state, expected)
            resumed += 1
        needed = len(prompt) - match.length
        if cache.allocator.available_size() < needed:
            cache.evict(needed - cache.allocator.available_size())
        table = cache.req_to_token_pool.req_to_token
        table[req.req_pool_idx, :match.length] = match.indices.to(torch.int32)
        table[req.req_pool_idx, match.length:len(prompt)] = cache.allocator.alloc(needed).to(torch.int32)
        req.kv_len = len(prompt)
        cache.cache_unfinished_req(req, prompt)
        cache.check_invariants()
        # The batch: the working state and the snapshots the tree handed out for this extend.
        write_states(cache, req.req_pool_idx, prompt)
        if req.pending_snapshot != NO_SNAPSHOT:
            write_states(cache, req.pending_snapshot, prompt)
        if req.pending_snapshot_before_last != NO_SNAPSHOT:
            write_states(cache, req.pending_snapshot_before_last, prompt[:-1])
        req.state_len = len(prompt)
        finish(cache, req)
        if rng.random() < 0.3:
            cache.evict(rng.randint(1, 96))
            cache.check_invariants()
    assert resumed > 20 and cache.snapshots_loaded > 0
    cache.reset()
    cache.check_invariants()
    assert cache.host_state_pool.available() == cache.host_state_pool.size
    assert cache.state_pool.available_snapshots() == cache.state_pool.num_snapshot_slots


# ---- through the scheduler -------------------------------------------------------------------------------------

# 8 conversations x 6 turns (up to 120 tokens each, 960 in all) over 400 device KV slots, 4 requests at a time.
SMALL_POOL = dict(max_total_tokens=400, max_running_requests=4, max_mamba_cache_size=40)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_5")


@pytest.fixture(scope="module")
def uncached(model_dir):
    return multi_turn(model_dir, disable_radix_cache=True, **SMALL_POOL)[0]


@pytest.fixture(scope="module")
def one_tier_cached(model_dir):
    return multi_turn(model_dir, disable_overlap_schedule=True, **SMALL_POOL)[1]


@pytest.mark.parametrize("config", [
    dict(disable_overlap_schedule=True),
    dict(disable_overlap_schedule=False, chunked_prefill_size=16, hicache_write_policy="write_back"),
], ids=["write-through", "write-back-overlap-chunked"])
def test_multi_turn_hits_the_host_tier(config, model_dir, uncached, one_tier_cached):
    driver = SchedulerDriver(model_dir, enable_hierarchical_cache=True, **SMALL_POOL, **config)
    answers, cached = multi_turn(model_dir, driver=driver)
    assert answers == uncached
    cache = driver.scheduler.cache
    assert isinstance(cache, HybridHiRadixCache)
    assert cache.counters.loaded_from_host_tokens > 0 and cache.snapshots_loaded > 0
    assert sum(cached) > 2 * sum(one_tier_cached), (sum(cached), sum(one_tier_cached))
    # multi_turn closed the driver: the flush left no KV, snapshot or host slot held.
    assert cache.num_snapshots() == 0 and cache.host_size() == 0
    assert driver.runner.state_pool.available_snapshots() == driver.runner.state_pool.num_snapshot_slots
    assert cache.host_state_pool.available() == cache.host_state_pool.size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_multi_turn_hits_the_host_tier_on_cuda(model_dir):
    """The same workload on a CUDA device, where the snapshot copies cross the bus (pinned host memory) in order
    with the batches that write and read them; the overlap scheduler on."""
    common = dict(device="cuda", dtype="float32", attention_backend="triton", **SMALL_POOL)
    expected, _ = multi_turn(model_dir, disable_radix_cache=True, **common)
    driver = SchedulerDriver(model_dir, enable_hierarchical_cache=True, disable_overlap_schedule=False, **common)
    answers, _ = multi_turn(model_dir, driver=driver)
    assert answers == expected
    assert driver.scheduler.cache.snapshots_loaded > 0


def test_a_disk_tier_is_refused_for_a_hybrid(model_dir, tmp_path):
    """The disk tier keeps no snapshots, so nothing could resume from it."""
    with pytest.raises(ValueError, match="disk tier keeps no recurrent-state snapshots"):
        SchedulerDriver(model_dir, enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path), **SMALL_POOL)
