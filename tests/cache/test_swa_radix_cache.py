"""The radix cache and allocator of sliding-window models with window slots (radix_cache/swa.py, swa_pool.py), on their
own: a match stops where the window KV of the W - 1 positions before its end is gone; both slot spaces are freed and
accounted; a request's window slots move to the tree's copies of the same tokens."""

from __future__ import annotations

import torch

from radixserve.radix_cache.pool import ReqToTokenPool
from radixserve.radix_cache.swa import SWARadixCache
from radixserve.radix_cache.swa_pool import SWAKVAllocator


def test_match_stops_where_the_window_kv_is_gone():
    allocator = SWAKVAllocator(64, 32)
    cache = SWARadixCache(ReqToTokenPool(2, 64), allocator, window=4)
    tokens = list(range(100, 120))
    slots = allocator.alloc(20)
    assert cache.insert(tokens, slots) == 0
    assert cache.match_prefix(tokens).length == 20
    allocator.release_window(slots[:10])  # positions 0..9 lose their window KV
    assert cache.resumable_length(slots) == 20
    assert cache.match_prefix(tokens[:14]).length == 14  # resuming at 14 reads 11..13
    assert cache.match_prefix(tokens[:12]).length == 0  # at 12 it would read 9..11, at 10 7..9: gone; and so on
    allocator.release_window(slots[15:16])
    assert cache.match_prefix(tokens).length == 20 and cache.match_prefix(tokens[:18]).length == 15
    match = cache.match_prefix(tokens[:17])
    assert match.length == 15 and torch.equal(match.indices, slots[:15])
    cache.check_invariants()
    allocator.check_window_invariants()
    cache.reset()
    assert allocator.available_size() == 64 and allocator.window_available_size() == 32
    allocator.check_window_invariants()


def test_allocator_frees_both_spaces_and_refuses_when_either_is_short():
    allocator = SWAKVAllocator(16, 6)
    first = allocator.alloc(4)
    assert allocator.alloc(3) is None  # 12 full slots left, 2 window slots
    assert allocator.available_size() == 12 and allocator.window_available_size() == 2
    assert allocator.release_window(first[:3]) == 3 and allocator.release_window(first[:3]) == 0
    second = allocator.alloc(5)
    assert second is not None and bool(allocator.has_window(second).all())
    allocator.check_window_invariants()
    allocator.adopt_window(first[:2], second[:2])  # the window slots of second[:2] move to first[:2]
    assert allocator.has_window(first).tolist() == [True, True, False, True]
    assert allocator.has_window(second).tolist() == [False, False, True, True, True]
    allocator.free(torch.cat([first, second]))
    allocator.check_window_invariants()
    assert allocator.available_size() == 16 and allocator.window_available_size() == 6
