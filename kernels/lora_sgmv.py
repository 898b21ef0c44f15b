"""Batched LoRA deltas as Triton kernels: a gather matmul where each token picks its adapter's matrix.

`gather_matmul(x, w, slots)`: `out[t] = w[slots[t]] @ x[t]` for `x [T, K]`, `w [S, N, K]` and `slots [T]` (int64; a
negative slot gives a zero row: a base-model token). LoRA runs it twice, shrink then expand:
`lora_delta(x, a, b, slots) = gather_matmul(gather_matmul(x, a, slots), b, slots)` with `a [S, r, in]` and
`b [S, out, r]` (the scale folded into b). One program computes BLOCK_N outputs of one token, accumulating in
float32 over K in blocks of BLOCK_K; a base-model token's program only writes zeros.

The torch path (`model_runner/lora/layers.py:segmented_lora`) is the reference (tests/ops/test_lora_kernel.py runs
this kernel under the Triton interpreter on machines without a GPU). Launch shape depends only on tensor
shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gather_matmul_kernel(
    X, W, Slots, Out,
    stride_x, stride_ws, stride_wn, stride_out,
    N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (token, n block): Out[t, n] = sum_k X[t, k] * W[slot[t], n, k]; zeros when slot < 0."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(Slots + t)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        w_rows = W + slot * stride_ws + n[:, None] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
    tl.store(Out + t * stride_out + n, acc.to(Out.dtype.element_ty), mask=n < N)


def gather_matmul(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`out [T, N]` with `out[t] = w[slots[t]] @ x[t]` (zero rows where `slots[t] < 0`), in x's dtype."""
    num_tokens, k = x.shape
    n = w.shape[1]
    assert w.shape[2] == k, f"w {tuple(w.shape)} does not take inputs of width {k}"
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens and n:
        grid = (num_tokens, triton.cdiv(n, BLOCK_N))
        _gather_matmul_kernel[grid](x, w, slots, out, x.stride(0), w.stride(0), w.stride(1), out.stride(0), n, k,
                                    BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`b[slot] @ (a[slot] @ x[t])` per token: the shrink to rank r, then the expand to the output width."""
    return gather_matmul(gather_matmul(x, a, slots), b, slots)
