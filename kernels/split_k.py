"""Split-K for the skinny GEMMs (kernels/w4a16_gemm.py, kernels/fp8_skinny_gemm.py, and the tiled W4A16 kernel at a
few dozen rows): how many K splits fill the GPU, and how the splits' partial sums meet, in the same launch.

At a few rows a GEMM has few output tiles (4096 columns in tiles of 64: 64 programs on 132 SMs), so each tile's K
range is split over several programs. Each writes its float32 partial sums to its own slice of a `[splits, ...]`
scratch and then counts itself in on the tile's counter; the program that arrives last reads every split's slice,
adds them in split order (so the result does not depend on which program ran when), writes the output in its dtype and
sets the counter back to zero. No zero fill, no atomics on the data, and no second kernel: a split product is one
launch, like an unsplit one.

The ordering is the grid-wide barrier's: every thread's stores, then a CTA barrier, then one thread's gpu-scope
acquire-release increment (a fence before it, an L1 invalidation after); the last program's threads read the slices
from L2 (`.cg`) after the barrier that hands them the count.

The counters (`split_counters`) are one zeroed int32 buffer per device that every split call shares and leaves zeroed:
calls on one stream (a model's forward, a CUDA graph's replay) follow each other, so each finds its tiles' counters at
zero. The same hand-over, and the same buffer, serve the triton backend's decode attention (its splits of the keys,
kernels/triton_attention.py) and the MoE router fused with its routing (kernels/moe_routing.py). Two such calls
running at once on two streams of one device would share them; nothing here does that.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_SPLIT_K = 16


class SkinnyConfig(NamedTuple):
    """A skinny kernel's tile (W4A16 or FP8 weights): `block_n` output columns, `block_k` input features a K step,
    `split_k` programs a column block, FMAs for one row a program or (`use_dot`) the tensor cores on 16 rows."""

    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int
    num_stages: int


_counters: dict[torch.device, torch.Tensor] = {}


def split_k_to_fill(tiles: int, k_tiles: int, num_sms: int, min_k_tiles: int = 2, waves: int = 2) -> int:
    """The smallest power-of-two split that brings `tiles * split` programs to `waves` per SM, keeping at least
    `min_k_tiles` K tiles per split (and at most `MAX_SPLIT_K` splits)."""
    split = 1
    while tiles * split < waves * num_sms and (split * 2) * min_k_tiles <= k_tiles and split < MAX_SPLIT_K:
        split *= 2
    return split


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed int32 counters on `device`, the same buffer for every call that fits in it (see the
    module docstring). Allocated at a call's first use of the size, normally outside a CUDA graph's capture (the
    warm-up call before it); allocated inside one, its zero fill is captured and replayed, which is harmless."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def split_buffers(out: torch.Tensor, split_k: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(partial, counters)` for a call writing `out [M, N]` in `split_k` splits over `tiles` output tiles: a float32
    `[split_k, M, N]` scratch and the shared counters; with one split, `out` twice (the kernel reads neither)."""
    if split_k == 1:
        return out, out
    return torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device), split_counters(out.device, tiles)


def num_sms(device: torch.device) -> int:
    """The device's SM count, which the split heuristics fill; 4 off CUDA (the interpreter's tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def split_k_tiles(K, BLOCK_K: tl.constexpr):
    """This program's K tiles `[first, last)`: split `program_id(2)`'s contiguous share of `num_programs(2)`."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    first = tl.program_id(2) * per_split
    return first, tl.minimum(first + per_split, k_tiles)


@triton.jit
def last_to_arrive(counter, arrivals):
    """Whether this program is the last of `arrivals` programs to count themselves in on `counter`, after its own
    stores: a CTA barrier (every thread's stores done), then one gpu-scope acquire-release increment. The last one
    reads the others' stores from L2 (`.cg`) and sets the counter back to zero when done."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def store_split(acc, Out, Partial, offsets, stride_split, mask, Counters, SPLIT: tl.constexpr):
    """Store a program's `acc` (float32) at `offsets` of its output tile. Without `SPLIT` (one split), to `Out` in
    Out's dtype; with it, to its split's slice `Partial + split * stride_split` (split = `program_id(2)`, of
    `num_programs(2)`), and, if this program is the last of its tile's splits to arrive on the tile's counter (tile =
    `(program_id(0), program_id(1))`), the sum of all slices in split order to Out. `Partial` has Out's layout per
    split. A constexpr, so that an unsplit call compiles without the counters."""
    if not SPLIT:
        tl.store(Out + offsets, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        num_splits = tl.num_programs(2)
        counter = Counters + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(Partial + tl.program_id(2) * stride_split + offsets, acc, mask=mask)
        if last_to_arrive(counter, num_splits):
            total = tl.zeros_like(acc)
            for split in range(num_splits):
                total += tl.load(Partial + split * stride_split + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Out + offsets, total.to(Out.dtype.element_ty), mask=mask)
            tl.store(counter, 0)  # for the next call: a later launch, which sees it
