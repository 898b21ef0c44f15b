"""Block-scaled FP8 GEMM in Triton (the DeepSeek-V3 / Qwen3-FP8 layout).

`out[M, N] = sum over K blocks b of (a[:, b] @ w[:, b].T) * a_scale[:, b] * w_scale[n // BN, b]`: `a [M, K]` FP8 e4m3
activations quantized per token and per group of `block_k` features (`a_scale [M, K / block_k]` float32), `w [N, K]`
FP8 e4m3 weights quantized per `block_n x block_k` block (`w_scale [N / block_n, K / block_k]` float32). Each program
multiplies one K block of FP8 tiles on the tensor cores (float32 accumulation), then applies the block's two scales to
the partial product before adding it to its float32 accumulator; the result is stored in `out_dtype`.

Shapes depend only on (M, N, K), so a call can be captured in a CUDA graph. Without CUDA the kernel runs only under
the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_kernel(
    A, W, AScale, WScale, Out,
    M, N, K,
    stride_am, stride_wn, stride_asm, stride_wsn, stride_om,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (block of rows, block of output columns); its K step is one scale block (`GROUP_K`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, GROUP_K)
    a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_ptrs = W + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    a_scale_ptrs = AScale + rows.to(tl.int64) * stride_asm
    w_scale_ptrs = WScale + (cols // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, tl.cdiv(K, GROUP_K)):
        k_ok = ks < K - block * GROUP_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + block, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptrs + block, mask=col_ok, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        a_ptrs += GROUP_K
        w_ptrs += GROUP_K
    tl.store(Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`[M, N]` in `out_dtype` from `a [M, K]`, `a_scale [M, K / block_k]`, `w [N, K]`, `w_scale [N / block_n,
    K / block_k]` (see the module docstring); `block_size` is `(block_n, block_k)`."""
    block_n, block_k = block_size
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k and a.stride(1) == 1 and w.stride(1) == 1
    assert a_scale.shape == (m, triton.cdiv(k, block_k)) and w_scale.shape == (triton.cdiv(n, block_n),
                                                                                triton.cdiv(k, block_k))
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 64
    tile_n = min(block_n, 64 if m <= 64 else 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile_n))
    _fp8_block_kernel[grid](
        a, w, a_scale, w_scale, out, m, n, k,
        a.stride(0), w.stride(0), a_scale.stride(0), w_scale.stride(0), out.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=block_m, BLOCK_N=tile_n,
        num_warps=4, num_stages=3,
    )
    return out
