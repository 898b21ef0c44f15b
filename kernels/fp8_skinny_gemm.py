"""FP8 weights times 16-bit activations for a few rows (decode), in Triton: the weight is dequantized in registers.

At one row a product reads its weight once and does two flops per byte of FP8: its time is the weight's bytes over
the memory bandwidth. cuBLASLt's FP8 GEMM is built for the other end (128 x 128 tiles of quantized activations); at one
row on an H200 it streams Llama-3.1-8B's FP8 projections at about 1.8 TB/s, and the activations' quantization costs
a kernel per call on top. Here the activations stay unquantized and the product is the dequantized weight's, as
Hugging Face computes it, with no activation rounding. Each program loads a `BLOCK_N x BLOCK_K` tile of the FP8
weight once, 16 bytes a thread along K (the weight's contiguous dimension), and widens it in registers; two kernels
multiply it:

- FMA (`use_dot` off): one row a program; the FP8 bytes widen to float32 through half precision (two values an
  instruction, then a full-rate half-to-single add, where a direct FP8-to-bfloat16 conversion takes a quarter-rate
  instruction per value), and each thread multiplies its run of K and reduces it with its neighbours';
- tensor cores (`use_dot`): up to 16 rows on one 16-row tile, the weight widened to the activations' dtype.

Both accumulate in float32; the weight's scales are applied per output column at the end (per channel; a per-tensor
checkpoint's scale comes spread over the rows) or per K tile (128 x 128 blocks). Few output tiles split K over
`split_k` programs per tile; each writes its float32 partial sums to its own slice of a scratch, and the last to
finish adds them in split order and casts, in the same launch (kernels/split_k.py). Shapes depend only on (M, N, K),
so calls can be captured in CUDA graphs. Without CUDA the kernels run only under the Triton interpreter
(`TRITON_INTERPRET=1` set before `triton` is imported).

The same kernels multiply 16-bit weights with no scale (`w16a16_gemm`): for the decode shapes where cuBLAS streams
a 16-bit weight slowly (`TUNED_16BIT`; model_runner/skinny_linear.py), they stream it near the copy bandwidth.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.pdl import launch_options, wait_previous
from radixserve.kernels.split_k import (SkinnyConfig, num_sms, split_buffers, split_k_tiles, split_k_to_fill,
                                        store_split)

# Up to this many rows a call takes these kernels (the tensor-core tile pads the rows to 16); more take the FP8
# tensor-core GEMMs.
MAX_ROWS = 16
# Up to this many rows the FMA kernel serves by default: it widens the weight once per row, the tensor-core kernel
# once per 16 rows.
FMA_MAX_ROWS = 1


# Measured configs, pasted from benchmarks/tune_w4a16.py's output (which also tunes this kernel) on the GPU its
# comment names: (N, K, block scales or None) -> rows (max_rows, config) in increasing max_rows; a call with M rows
# takes the first row with M <= max_rows. Shapes absent, and row counts past the last row, take `fp8_skinny_config`'s
# defaults.
TUNED: dict[tuple[int, int, Optional[tuple[int, int]]], list[tuple[int, SkinnyConfig]]] = {
    # NVIDIA H100 80GB HBM3, 132 SMs, per-channel FP8 at one row, medians with L2 flushed (us, tuned against the
    # defaults below): Llama-3.1-8B's qkv 17.4 / 18.6, o 14.2 / 14.6, gate/up 52.7 / 55.7, down 32.2 / 33.7.
    (6144, 4096, None): [(1, SkinnyConfig(64, 256, 4, False, 8, 3))],
    (4096, 4096, None): [(1, SkinnyConfig(32, 256, 4, False, 8, 3))],
    (28672, 4096, None): [(1, SkinnyConfig(64, 256, 1, False, 4, 3))],
    (4096, 14336, None): [(1, SkinnyConfig(64, 256, 8, False, 4, 3))],
}
# The same for 16-bit weights, (N, K) -> rows (max_rows, config), for the shapes and row counts where the kernel
# measured faster than cuBLAS (`F.linear`): model_runner/skinny_linear.py gives exactly these layers the kernel, up to
# the last row's max_rows. NVIDIA H100 80GB HBM3, 132 SMs, medians with L2 flushed (us, skinny against cuBLAS, at
# 1 and 8 rows): Qwen3-30B-A3B's qkv (5120 x 2048: 15.2 / 15.9, then 15.5 / 15.7, kept at one row), o (13.2 / 15.4,
# 13.2 / 15.1) and router (6.7 / 8.6, 6.7 / 8.0); Llama-3.1-8B's qkv (28.4 / 29.2, 27.8 / 29.3), o (20.4 / 22.6,
# 21.0 / 22.3), gate/up (90.1 / 92.3, 89.8 / 92.3) and down (52.9 / 54.6, 53.0 / 54.4).
TUNED_16BIT: dict[tuple[int, int], list[tuple[int, SkinnyConfig]]] = {
    (5120, 2048): [(1, SkinnyConfig(32, 256, 2, False, 8, 3))],
    (2048, 4096): [(1, SkinnyConfig(32, 256, 4, False, 8, 3)), (8, SkinnyConfig(64, 128, 4, True, 4, 4))],
    (128, 2048): [(1, SkinnyConfig(32, 128, 8, True, 4, 3)), (8, SkinnyConfig(32, 64, 8, True, 4, 4))],
    (6144, 4096): [(1, SkinnyConfig(128, 128, 8, False, 4, 3)), (8, SkinnyConfig(64, 256, 1, True, 4, 4))],
    (4096, 4096): [(1, SkinnyConfig(32, 256, 4, False, 4, 3)), (8, SkinnyConfig(64, 128, 2, True, 4, 4))],
    (28672, 4096): [(8, SkinnyConfig(32, 128, 1, True, 4, 3))],
    (4096, 14336): [(1, SkinnyConfig(32, 256, 4, False, 4, 3)), (8, SkinnyConfig(64, 128, 4, True, 4, 3))],
}


def fp8_skinny_config(m: int, n: int, k: int, block: Optional[tuple[int, int]], num_sms: int) -> SkinnyConfig:
    """The config for an (m, n, k) product: the measured one where `TUNED` has a row for it, else one row on FMAs and
    more on the tensor cores, in tiles of 64 columns by 128 features (8 KiB), with K split until each SM has about
    four programs loading their tiles."""
    rows = TUNED.get((n, k, block))
    if rows and m <= rows[-1][0]:
        return next(config for max_rows, config in rows if m <= max_rows)
    use_dot = m > FMA_MAX_ROWS
    block_n, block_k = 64, 128 if block is None else min(128, block[1])
    programs = triton.cdiv(n, block_n) * (1 if use_dot else m)
    split_k = split_k_to_fill(programs, triton.cdiv(k, block_k), num_sms, min_k_tiles=2, waves=4)
    return SkinnyConfig(block_n, block_k, split_k, use_dot, num_warps=4, num_stages=4 if use_dot else 3)


def skinny_16bit_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """The config for an (m, n, k) product of a 16-bit weight: `TUNED_16BIT`'s where it has the shape, else the FP8
    default with K tiles of half the features (the same bytes a tile)."""
    rows = TUNED_16BIT.get((n, k))
    if rows:
        return next((config for max_rows, config in rows if m <= max_rows), rows[-1][1])
    config = fp8_skinny_config(m, n, k, None, num_sms)
    return config._replace(block_k=64)


@triton.jit
def _widen(w):
    """A weight tile in float32: FP8 through half precision (exact: e4m3 fits in it; two values an instruction, then
    a full-rate half-to-single conversion), 16-bit weights directly."""
    if w.dtype == tl.float8e4nv:
        return w.to(tl.float16).to(tl.float32)
    return w.to(tl.float32)


@triton.jit
def _w8a16_fma_kernel(
    X, W, Scale, Out, Partial, Counters, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BLOCK_SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (row, block of output columns, K split): one row's sums over split `program_id(2)`'s share of K, to
    Out (or to Partial, the last split adding them up: kernels/split_k.py). The rows of a column block are adjacent
    programs, so a few rows read the weight from memory once and from L2 after."""
    wait_previous(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    first, last = split_k_tiles(K, BLOCK_K)
    x_row = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(first, last):
        k = tile * BLOCK_K + ks
        k_ok = k < K
        if EVEN_K:  # no K tail: masks by column only (none on the activations)
            w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :], mask=col_ok[:, None], other=0.0)
            x = tl.load(x_row + k).to(tl.float32)
        else:
            w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(_widen(w) * x[None, :], axis=1)
        if BLOCK_SCALES:  # a K tile lies inside one scale block (the wrapper checks)
            acc += part * tl.load(Scale + (cols // GROUP_N) * stride_sn + (tile * BLOCK_K) // GROUP_K, mask=col_ok,
                                  other=0.0)
        else:
            acc += part
    if HAS_SCALE and not BLOCK_SCALES:
        acc *= tl.load(Scale + cols, mask=col_ok, other=0.0)
    offsets = row * stride_om + cols
    store_split(acc, Out, Partial, offsets, stride_os, col_ok, Counters, SPLIT)


@triton.jit
def _w8a16_dot_kernel(
    X, W, Scale, Out, Partial, Counters, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BLOCK_SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (block of 16 rows, block of output columns, K split) on the tensor cores; output as in
    `_w8a16_fma_kernel`."""
    wait_previous(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    first, last = split_k_tiles(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        k = tile * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if w.dtype == tl.float8e4nv:
            w = w.to(tl.float16)  # exact, and a 16-bit operand for the tensor cores
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        if BLOCK_SCALES:
            scale = tl.load(Scale + (cols // GROUP_N) * stride_sn + (tile * BLOCK_K) // GROUP_K, mask=col_ok,
                            other=0.0)
            acc += part * scale[None, :]
        else:
            acc += part
    if HAS_SCALE and not BLOCK_SCALES:
        acc *= tl.load(Scale + cols, mask=col_ok, other=0.0)[None, :]
    offsets = rows[:, None] * stride_om + cols[None, :]
    store_split(acc, Out, Partial, offsets, stride_os, row_ok[:, None] & col_ok[None, :], Counters, SPLIT)


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
               config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """`x [M, K] @ (weight * scale).T -> [M, N]` in x's dtype, for M <= MAX_ROWS: `weight [N, K]` float8_e4m3fn,
    `scale` float32 `[N]` per output channel or `[ceil(N / bn), ceil(K / bk)]` for `block = (bn, bk)`."""
    if config is None:
        config = fp8_skinny_config(x.shape[0], weight.shape[0], x.shape[1], block, num_sms(x.device))
    if block is not None and block[1] % config.block_k:
        raise ValueError(f"an FP8 K tile of {config.block_k} must lie inside one {block[0]}x{block[1]} scale block")
    return _skinny_gemm(x, weight, scale, block, config)


def w16a16_gemm(x: torch.Tensor, weight: torch.Tensor, config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """`x [M, K] @ weight.T -> [M, N]` in x's dtype, for M <= MAX_ROWS and a 16-bit `weight [N, K]`: the same kernels
    with no scale, for the decode products whose shapes cuBLAS streams slowly (`skinny_16bit_config`)."""
    if config is None:
        config = skinny_16bit_config(x.shape[0], weight.shape[0], x.shape[1], num_sms(x.device))
    return _skinny_gemm(x, weight, None, None, config)


def _skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                 block: Optional[tuple[int, int]], config: SkinnyConfig) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial, counters = split_buffers(out, config.split_k, m * triton.cdiv(n, config.block_n))
    args = (x, weight, weight if scale is None else scale, out, partial, counters, m, n, k, x.stride(0),
            weight.stride(0), scale.stride(0) if block is not None else 0, m * n, out.stride(0))
    scales = dict(BLOCK_SCALES=block is not None, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else 1,
                  HAS_SCALE=scale is not None, SPLIT=config.split_k > 1)
    launch = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                  num_stages=config.num_stages, **launch_options(x))
    if config.use_dot:
        grid = (triton.cdiv(m, 16), triton.cdiv(n, config.block_n), config.split_k)
        _w8a16_dot_kernel[grid](*args, **scales, PRECISION="ieee" if x.dtype == torch.float32 else None,
                                BLOCK_M=16, **launch)
    else:
        _w8a16_fma_kernel[(m, triton.cdiv(n, config.block_n), config.split_k)](
            *args, **scales, EVEN_K=k % config.block_k == 0, **launch)
    return out
