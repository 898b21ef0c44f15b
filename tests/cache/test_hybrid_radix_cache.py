"""The hybrid radix cache (radix_cache/hybrid.py) on real pools, without a model: where snapshots go and how they leave.

Each step is followed by `check_invariants` (KV slots and every snapshot slot free or held by exactly one node).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.radix_cache.hybrid import NO_SNAPSHOT, HybridRadixCache
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.state_pool import StatePool
from radixserve.scheduler.req import Req
from radixserve.runtime.wire.sampling_params import SamplingParams

ROWS = 4


def make_cache(snapshots: int = 4) -> HybridRadixCache:
    rows = ReqToTokenPool(ROWS, 64)
    states = StatePool(ROWS, ROWS + snapshots, num_layers=2, conv_dim=3, conv_width=4, num_heads=2, key_dim=2,
                       value_dim=2, ssm_dtype=torch.float32, conv_dtype=torch.float32)
    return HybridRadixCache(rows, KVAllocator(256), states)


def admit(cache: HybridRadixCache, prompt: list[int], namespace: tuple = ()) -> Req:
    """What the scheduler does for a request computing `prompt` in one extend: match, lock, take a row and slots,
    hand the extend to the tree; then the batch's plan records how far its state reaches."""
    req = Req(f"r{len(prompt)}-{prompt[0]}", prompt, SamplingParams(max_new_tokens=4), namespace=namespace)
    match = cache.match_prefix(prompt[:-1], namespace)
    cache.inc_lock_ref(match.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    req.prefix_indices, req.last_node = match.indices, match.last_node
    table = cache.req_to_token_pool.req_to_token
    table[req.req_pool_idx, :match.length] = match.indices.to(torch.int32)
    slots = cache.allocator.alloc(len(prompt) - match.length)
    table[req.req_pool_idx, match.length:len(prompt)] = slots.to(torch.int32)
    req.kv_len = len(prompt)
    cache.cache_unfinished_req(req, prompt)
    req.state_len = len(prompt)
    cache.check_invariants(held_slots=0)
    return req, match.length


def finish(cache: HybridRadixCache, req: Req) -> None:
    cache.cache_finished_req(req, req.all_ids[:req.kv_len])
    cache.req_to_token_pool.free(req.req_pool_idx)
    cache.check_invariants(held_slots=0)


def test_snapshots_at_the_prompt_end_and_one_before_then_the_same_prompt_hits():
    cache = make_cache()
    prompt = list(range(10, 20))
    req, cached = admit(cache, prompt)
    assert cached == 0
    assert req.pending_snapshot != NO_SNAPSHOT and req.pending_snapshot_before_last != NO_SNAPSHOT
    finish(cache, req)
    again, cached = admit(cache, prompt)
    assert cached == len(prompt) - 1  # resumes from the snapshot one token before the end
    assert cache.state_snapshot(again.last_node, cached) == req.pending_snapshot_before_last
    finish(cache, again)


def test_a_match_stops_at_the_deepest_snapshot_and_a_split_keeps_it_below():
    cache = make_cache()
    first, _ = admit(cache, list(range(30)))
    finish(cache, first)
    # Diverges at 20, where no snapshot is: nothing to resume from (the snapshots are at 29 and 30).
    other, cached = admit(cache, list(range(20)) + [99, 98, 97])
    assert cached == 0
    finish(cache, other)
    # The split at 20 left the snapshots where they were: the first prompt again still resumes at 29.
    again, cached = admit(cache, list(range(30)))
    assert cached == 29
    finish(cache, again)


def test_lru_budget_spares_locked_snapshots_and_kv_eviction_frees_them():
    cache = make_cache(snapshots=4)
    held, _ = admit(cache, [1, 2, 3, 4])  # running: its two snapshots are locked
    for start in (100, 200, 300):
        req, _ = admit(cache, [start, start + 1, start + 2])
        finish(cache, req)
    assert cache.num_snapshots() == 4  # the budget, spent; the oldest unlocked ones went first
    kept = {node.state_slot for node in cache._snapshots}
    assert {held.pending_snapshot, held.pending_snapshot_before_last} <= kept  # the running request's stay
    last, cached = admit(cache, [300, 301, 302, 303])  # the newest finished request's end is still there
    assert cached == 3
    finish(cache, last)
    finish(cache, held)
    cache.evict(cache.evictable_size())
    assert cache.num_snapshots() == 0 and cache.state_pool.available_snapshots() == 4
    cache.check_invariants(held_slots=0)


def test_namespaces_and_flush():
    cache = make_cache()
    req, _ = admit(cache, [5, 6, 7, 8], namespace=("a",))
    finish(cache, req)
    other, cached = admit(cache, [5, 6, 7, 8], namespace=("b",))
    assert cached == 0
    finish(cache, other)
    assert cache.num_snapshots() == 4
    cache.reset()
    assert cache.num_snapshots() == 0 and cache.state_pool.available_snapshots() == 4
    cache.check_invariants(held_slots=0)


def test_a_state_pool_without_snapshot_slots_is_refused():
    with pytest.raises(ValueError, match="max-mamba-cache-size"):
        StatePool(4, 4, 1, 3, 4, 2, 2, 2, torch.float32, torch.float32)
