"""FP8 weights times 16-bit activations for a few rows (decode), in Triton: the weight is dequantized in registers.

At one row a product reads its weight once and does two flops per byte of FP8: its time is the weight's bytes over
the memory bandwidth. cuBLASLt's FP8 GEMM is built for the other end (128 x 128 tiles of quantized activations); at one
row on an H200 it streams Llama-3.1-8B's FP8 projections at about 1.8 TB/s, and the activations' quantization costs
a kernel per call on top. Here each program reads a `BLOCK_N x BLOCK_K` tile of the FP8 weight, widens it to the
activations' dtype and multiplies it on the tensor cores with the unquantized activations (rows padded to 16),
accumulating in float32; the weight's scales are applied per output column at the end (per channel) or per K tile
(128 x 128 blocks). The product is the dequantized weight's, as Hugging Face computes it, with no activation
rounding.

Few output tiles split K over `split_k` programs per tile; each writes its partial sums to a float32 scratch row, and
one reduction kernel adds them in split order and casts (so the result does not depend on the programs' timing).
Shapes depend only on (M, N, K), so calls can be captured in CUDA graphs. Without CUDA the kernels run only under the
Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Up to this many rows a call takes this kernel (its tiles pad the rows to 16); more take the FP8 tensor-core GEMMs.
MAX_ROWS = 16
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128


@triton.jit
def _w8a16_kernel(
    X, W, Scale, Out, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BLOCK_SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block of output columns, K split): its share of K tiles, contiguous; writes split `split`'s partial
    sums (or, with one split, the result in Out's dtype)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = split * per_split
    last = tl.minimum(first + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        k_ok = k0 + ks < K
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        part = tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
        if BLOCK_SCALES:  # a K tile lies inside one scale block (the wrapper checks)
            scale = tl.load(Scale + (cols // GROUP_N) * stride_sn + k0 // GROUP_K, mask=col_ok, other=0.0)
            acc += part * scale[None, :]
        else:
            acc += part
    if not BLOCK_SCALES:
        acc *= tl.load(Scale + cols, mask=col_ok, other=0.0)[None, :]
    out = Out + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(Partial, Out, N, stride_ps, stride_pm, stride_om, SPLIT_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Program (row, block of columns): the splits' partial sums added in split order, cast to Out's dtype."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(Partial + split * stride_ps + row * stride_pm + cols, mask=col_ok, other=0.0)
    tl.store(Out + row * stride_om + cols, acc.to(Out.dtype.element_ty), mask=col_ok)


def split_k_for(n: int, k: int, num_sms: int) -> int:
    """K splits that bring the programs near two per SM, keeping at least two K tiles per split."""
    tiles, k_tiles = triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= k_tiles // 2 and split < 16:
        split *= 2
    return split


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
               split_k: Optional[int] = None) -> torch.Tensor:
    """`x [M, K] @ (weight * scale).T -> [M, N]` in x's dtype, for M <= MAX_ROWS: `weight [N, K]` float8_e4m3fn,
    `scale` float32 `[N]` per output channel or `[ceil(N / bn), ceil(K / bk)]` for `block = (bn, bk)`."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    x = x.contiguous()
    block_k = BLOCK_K
    if block is not None:
        block_k = min(BLOCK_K, block[1])
        assert block[1] % block_k == 0, "a K tile must lie inside one scale block"
    if split_k is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        split_k = split_k_for(n, k, num_sms)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _w8a16_kernel[(triton.cdiv(n, BLOCK_N), split_k)](
        x, weight, scale, target, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0) if block is not None else 0,
        target.stride(0) if split_k > 1 else 0, target.stride(-2),
        BLOCK_SCALES=block is not None, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else 1,
        SPLIT_K=split_k, PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )
    if split_k > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, 256))](
            target, out, n, target.stride(0), target.stride(1), out.stride(0), SPLIT_K=split_k, BLOCK_N=256,
        )
    return out
