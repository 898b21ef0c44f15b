"""`x @ W.T (+ b)` whose every output row has the same bits whatever rows share the call (deterministic inference).

cuBLAS picks its kernel, its tiles and often a split of the reduction by the problem's shape, so a row's result
depends on how many rows came with it; a rollout's logprobs then move with the batch it happened to land in. Here the
tiles are fixed (`BLOCK_M` x `BLOCK_N`, the reduction walked in `BLOCK_K` steps from 0 to K, never split), so an
output element is the same float32 sum of the same products in the same order for any row count: the row's tile
position and its neighbours change which program computes it, not how.

The price is the tile choice for every shape: one decode row still fills a `BLOCK_M` tile, and with no split-K a
skinny call runs `ceil(N / BLOCK_N)` programs. benchmarks/deterministic_cost.py measures it against the normal mode.
Launch shape depends only on the tensor shapes, so calls can be captured in CUDA graphs. Without CUDA the kernel runs
under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is imported), as the tests run it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# One configuration for every shape: that is the point. 64 x 64 output tiles keep enough programs in flight for the
# decode shapes (N / 64 of them) and still run the tensor cores at prefill shapes.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
GROUP_M = 8


@triton.jit
def _matmul_kernel(
    X, W, Bias, Out, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program = one BLOCK_M x BLOCK_N output tile; programs are ordered in groups of GROUP_M row tiles so that
    neighbours share W's tiles in L2 (an order of programs, which changes no sum)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < M
    col_mask = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k + k < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with row-invariant bits: x `[..., K]`, weight `[N, K]` (row-major), bias `[N]`;
    the result has x's dtype. float32 inputs multiply in IEEE float32 (no TF32)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features and the weight {weight.shape[1]}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        _matmul_kernel[grid](
            rows, weight, bias if bias is not None else weight, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        )
    return out.reshape(*x.shape[:-1], n)
