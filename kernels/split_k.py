"""Split-K for the skinny GEMMs (kernels/w4a16_gemm.py, kernels/fp8_skinny_gemm.py): how many K splits fill the GPU,
and the kernel that adds the splits' partial sums.

At a few rows a GEMM has few output tiles (4096 columns in tiles of 64: 64 programs on 132 SMs), so each tile's K
range is split over several programs. Each writes its float32 partial sums to its own slice of a `[splits, M, N]`
scratch (no zero fill, no atomics), and one small kernel adds the slices in split order and casts to the output's
dtype: two launches a call, and a result that does not depend on the order in which the programs ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLIT_K = 16


def split_k_to_fill(tiles: int, k_tiles: int, num_sms: int, min_k_tiles: int = 2, waves: int = 2) -> int:
    """The smallest power-of-two split that brings `tiles * split` programs to `waves` per SM, keeping at least
    `min_k_tiles` K tiles per split (and at most `MAX_SPLIT_K` splits)."""
    split = 1
    while tiles * split < waves * num_sms and (split * 2) * min_k_tiles <= k_tiles and split < MAX_SPLIT_K:
        split *= 2
    return split


@triton.jit
def _sum_splits_kernel(Partial, Out, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (block of the flattened output): the splits' partial sums added in split order, cast to Out's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(Partial + split * numel + offsets, mask=ok, other=0.0)
    tl.store(Out + offsets, acc.to(Out.dtype.element_ty), mask=ok)


def sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out[...] = partial.sum(0)` for a contiguous float32 `partial [splits, *out.shape]` and a contiguous `out`."""
    assert partial.is_contiguous() and out.is_contiguous() and partial.shape[1:] == out.shape, (partial.shape,
                                                                                                 out.shape)
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](partial, out, numel, SPLIT_K=partial.shape[0], BLOCK=block,
                                                     num_warps=4)
    return out
