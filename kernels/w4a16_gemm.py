"""W4A16 GEMM in Triton: 16-bit activations times 4-bit grouped weights, dequantized in registers.

`out[M, N] = x[M, K] @ W.T` with `W[n, k] = (q[n, k] - zeros[g(k), n]) * scales[g(k), n]`, where `q` holds unsigned
4-bit values packed eight along K into int32 words, `qweight[K / 8, N]` (value `k` in bits `4 * (k % 8)` of word
`k // 8`), and `g(k)` is the group of input feature `k`: `k // group_size`, or `g_idx[k]` for GPTQ's act-order
checkpoints, whose groups are not contiguous runs of K. The weight crosses memory once, at half a byte per value.

Two kernels, by row count:

- skinny (up to `SKINNY_MAX_ROWS` rows: decode). A product of one row is the weight's bytes over the memory bandwidth,
  and the dequantization's instructions are what can keep it from there: each program loads its
  `[BLOCK_K / 8, BLOCK_N]` packed words once and unpacks the eight nibbles of a word in registers, a nibble becoming
  a float by a bit trick, not a conversion instruction (`_nibble_plus_16`). Without `g_idx` the zero point and scale
  are applied per word row or per tile and column, not per weight. With FMAs (`use_dot` off) a
  program multiplies one row and keeps its sums per word row until the end; on the tensor cores (`use_dot`) the
  unpacked tile goes to `tl.dot` with up to 16 rows (its values are exact in 16 bits). K is split over `split_k`
  programs per column block when the blocks alone would leave the SMs short of loads in flight; the last split to
  finish adds the partial sums, in the same launch (kernels/split_k.py).
- tiled (prefill). Each program dequantizes a `[BLOCK_K, BLOCK_N]` tile in float32 (shift, mask, subtract,
  multiply) and multiplies it on the tensor cores with a `[BLOCK_M, BLOCK_K]` tile of the activations.
- dequantized (from `DEQUANTIZE_FROM_ROWS` rows in 16-bit: prefill chunks and large decode batches). The whole weight
  is written out in the activations' dtype (`w4a16_dequantize`, one pass over it) and multiplied by cuBLAS: the
  write costs about what cuBLAS takes for a few hundred rows, and from there the tiled kernel, which unpacks every
  tile once per row block, is 1.3-3x slower than the two together.

Both accumulate in float32; float32 activations multiply in IEEE float32. Shapes depend only on (M, N, K), so a call
can be captured in a CUDA graph. Without CUDA the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1`
set before `triton` is imported).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from radixserve.kernels.pdl import launch_options, wait_previous
from radixserve.kernels.split_k import (SkinnyConfig, num_sms, split_buffers, split_k_tiles, split_k_to_fill,
                                        store_split)

PACK_FACTOR = 8  # 4-bit values per int32 word
# Up to this many rows a call takes the skinny kernel.
SKINNY_MAX_ROWS = 16
# From this many rows a 16-bit call dequantizes the weight and runs cuBLAS. Measured against the tiled kernel on an H100
# (benchmarks/w4a16_prefill.py, Llama-3.1-8B's four projections summed): 0.46 against 0.32 ms at 64 rows, 0.50 against
# 0.69 at 256, 0.87 against 2.23 at 1024, 2.73 against 8.14 at 4096 (bf16 cuBLAS alone: 2.52).
DEQUANTIZE_FROM_ROWS = 256
# Up to this many rows the skinny kernel multiplies with FMAs by default, above it on the tensor cores: an FMA
# program dequantizes its tile for one row, a tensor-core program for 16.
FMA_MAX_ROWS = 1


class W4A16Config(NamedTuple):
    """The tiled (prefill) kernel's tile."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# Measured configs, pasted from benchmarks/tune_w4a16.py's output on the GPU its comment names: (N, K, group size) of
# a projection without g_idx -> rows (max_rows, config) in increasing max_rows; a call with M rows takes the first row
# with M <= max_rows (the last row beyond). The split is the measured one, for that GPU's SM count. Shapes absent
# take `skinny_config`'s defaults.
TUNED_SKINNY: dict[tuple[int, int, int], list[tuple[int, SkinnyConfig]]] = {
    # NVIDIA H100 80GB HBM3, 132 SMs: Llama-3.1-8B's projections (qkv, o, gate_up, down), groups of 128
    (6144, 4096, 128): [(1, SkinnyConfig(64, 512, 4, False, 4, 3)), (4, SkinnyConfig(128, 128, 8, True, 4, 3)),
                        (16, SkinnyConfig(128, 128, 8, True, 4, 4))],
    (4096, 4096, 128): [(1, SkinnyConfig(32, 256, 4, False, 8, 3)), (4, SkinnyConfig(128, 128, 8, True, 4, 4)),
                        (16, SkinnyConfig(128, 128, 8, True, 4, 3))],
    (28672, 4096, 128): [(1, SkinnyConfig(128, 128, 4, False, 4, 3)), (4, SkinnyConfig(128, 64, 4, True, 4, 3)),
                         (16, SkinnyConfig(128, 64, 4, True, 4, 4))],
    (4096, 14336, 128): [(1, SkinnyConfig(64, 256, 8, False, 8, 3)), (4, SkinnyConfig(128, 128, 8, True, 4, 3)),
                         (16, SkinnyConfig(128, 64, 16, True, 4, 3))],
}


def _tile_k(group_size: int, has_g_idx: bool, largest: int) -> int:
    """A power-of-two K tile up to `largest` that, without `g_idx`, divides the group (a tile reads one group)."""
    block_k = largest
    while not has_g_idx and group_size % block_k and block_k > 16:
        block_k //= 2
    return block_k


def skinny_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool, num_sms: int) -> SkinnyConfig:
    """The skinny kernel's config for an (m, n, k) product: the measured one where `TUNED_SKINNY` has the shape, else
    one row on FMAs and more on the tensor cores, in tiles of 64 columns by 128 features (4 KiB of packed words),
    with K split until each SM has about four programs, each loading its own tile (at one row a few programs an SM
    keep too few bytes in flight to stream the weight)."""
    rows = TUNED_SKINNY.get((n, k, group_size)) if not has_g_idx else None
    if rows:
        return next((config for max_rows, config in rows if m <= max_rows), rows[-1][1])
    use_dot = m > FMA_MAX_ROWS
    block_n, block_k = 64, _tile_k(group_size, has_g_idx, 128) if use_dot else 128
    programs = triton.cdiv(n, block_n) * (triton.cdiv(m, 16) if use_dot else m)
    split_k = split_k_to_fill(programs, triton.cdiv(k, block_k), num_sms, min_k_tiles=2, waves=4)
    return SkinnyConfig(block_n, block_k, split_k, use_dot, num_warps=4, num_stages=3)


def w4a16_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool, num_sms: int) -> W4A16Config:
    """The tiled kernel's tile for an (m, n, k) product. Without `g_idx`, a K tile lies in one group (`block_k`
    divides `group_size`), so the program loads one row of scales per tile."""
    if m <= 64:
        block_m, block_n, block_k, warps, stages = 64 if m > 16 else 16, 64, 128, 4, 3
    else:  # K tiles of 64: at 128 the three stages of 128 x 128 tiles need 257 KiB of shared memory (H100: 227 KiB)
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    block_k = _tile_k(group_size, has_g_idx, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = split_k_to_fill(tiles, triton.cdiv(k, block_k), num_sms, min_k_tiles=4)
    return W4A16Config(block_m, block_n, block_k, split_k, warps, stages)


@triton.jit
def _nibble_plus_16(packed, j: tl.constexpr):
    """`16 + q` for the 4-bit values `q` at nibble `j` of uint32 words, as float32 scaled by 1/16: the nibble moved
    to the top of the mantissa of 1.0 (bits 19-22) reads as `1 + q / 16` exactly, with no conversion instruction."""
    if j <= 4:
        top = packed << (19 - 4 * j)
    else:
        top = packed >> (4 * j - 19)
    return ((top & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_fma_kernel(
    X, QWeight, Scales, Zeros, GIdx, Out, Partial, Counters,
    M, N, K,
    stride_xm, stride_qk, stride_sg, stride_os, stride_om,
    HAS_G_IDX: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (row, block of output columns, K split): one row's sums over split `program_id(2)`'s share of K, to
    Out (or to Partial, the last split adding them up: kernels/split_k.py). The rows of a column block are adjacent
    programs, so a few rows read the weight from memory once and from L2 after.

    Nibble j of the tile's word rows is input features `8 * word + j`: the loop over j reads those activations (a
    strided slice, from cache) and multiplies them with the nibbles where the words were loaded, keeping the sums per
    word row until the end. Without `g_idx` the nibbles are taken as `1 + q / 16` (see `_nibble_plus_16`), so per
    word row `t = sum_j x_j (1 + q_j / 16)` and `sum_j x_j (q_j - z) s = 16 s t - (16 + z) s sum_j x_j`: the zero
    point and scale cost a few operations per word, not per weight, and a K tile may span groups (the scale and
    zero point are read per word row, from cache)."""
    wait_previous(USE_PDL)
    WORDS: tl.constexpr = BLOCK_K // 8
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words = tl.arange(0, WORDS)
    first, last = split_k_tiles(K, BLOCK_K)
    x_row = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        word_rows = tile * WORDS + words
        word_ok = word_rows < K // 8
        packed = tl.load(QWeight + word_rows[:, None].to(tl.int64) * stride_qk + cols[None, :],
                         mask=word_ok[:, None] & col_ok[None, :], other=0).to(tl.uint32, bitcast=True)
        if HAS_G_IDX:
            for j in tl.static_range(8):
                ks = word_rows * 8 + j
                x = tl.load(x_row + ks, mask=word_ok, other=0.0).to(tl.float32)
                offsets = tl.load(GIdx + ks, mask=word_ok, other=0).to(tl.int64)[:, None] * stride_sg + cols[None, :]
                scale = tl.load(Scales + offsets, mask=col_ok[None, :], other=0.0).to(tl.float32)
                zero = tl.load(Zeros + offsets, mask=col_ok[None, :], other=0.0).to(tl.float32)
                q = (_nibble_plus_16(packed, j) - 1.0) * 16.0
                acc += x[:, None] * ((q - zero) * scale)
        else:
            plus_16 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((WORDS,), dtype=tl.float32)
            for j in tl.static_range(8):
                if EVEN_K:  # no K tail: the activations' loads need no mask (nor the zeroing a mask costs)
                    x = tl.load(x_row + word_rows * 8 + j).to(tl.float32)
                else:
                    x = tl.load(x_row + word_rows * 8 + j, mask=word_ok, other=0.0).to(tl.float32)
                plus_16 += x[:, None] * _nibble_plus_16(packed, j)
                x_sum += x
            # Each word row's group (a word's eight features share one): a tile may span several groups.
            offsets = ((word_rows * 8) // GROUP_SIZE * stride_sg)[:, None] + cols[None, :]
            mask = word_ok[:, None] & col_ok[None, :]
            scale = tl.load(Scales + offsets, mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(Zeros + offsets, mask=mask, other=0.0).to(tl.float32)
            acc += plus_16 * (16.0 * scale) - x_sum[:, None] * ((16.0 + zero) * scale)
    offsets = row * stride_om + cols
    store_split(tl.sum(acc, axis=0), Out, Partial, offsets, stride_os, col_ok, Counters, SPLIT)


@triton.jit
def _w4a16_dot_kernel(
    X, QWeight, Scales, Zeros, GIdx, Out, Partial, Counters,
    M, N, K,
    stride_xm, stride_qk, stride_sg, stride_os, stride_om,
    HAS_G_IDX: tl.constexpr, GROUP_SIZE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (block of 16 rows, block of output columns, K split) on the tensor cores; output as in
    `_w4a16_fma_kernel`. The words are loaded once and widened to `[BLOCK_K, BLOCK_N]` nibbles by a broadcast shift;
    `1 + q / 16` is exact in 16 bits, so without `g_idx` the tile goes to `tl.dot` as it is and the zero point and
    scale are applied to the product's columns."""
    wait_previous(USE_PDL)
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words = tl.arange(0, WORDS)
    ks = tl.arange(0, BLOCK_K)
    nibble_shifts = 19 - 4 * tl.arange(0, 8)  # per nibble: to bits 19-22, left (>= 0) or right
    left = tl.maximum(nibble_shifts, 0)[None, :, None].to(tl.uint32)
    right = tl.maximum(-nibble_shifts, 0)[None, :, None].to(tl.uint32)
    first, last = split_k_tiles(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        word_rows = tile * WORDS + words
        word_ok = word_rows < K // 8
        packed = tl.load(QWeight + word_rows[:, None].to(tl.int64) * stride_qk + cols[None, :],
                         mask=word_ok[:, None] & col_ok[None, :], other=0).to(tl.uint32, bitcast=True)
        top = (packed[:, None, :] << left) >> right
        plus_16 = ((top & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
        plus_16 = tl.reshape(plus_16, (BLOCK_K, BLOCK_N))
        k = tile * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if HAS_G_IDX:
            offsets = tl.load(GIdx + k, mask=k_ok, other=0).to(tl.int64)[:, None] * stride_sg + cols[None, :]
            scale = tl.load(Scales + offsets, mask=col_ok[None, :], other=0.0).to(tl.float32)
            zero = tl.load(Zeros + offsets, mask=col_ok[None, :], other=0.0).to(tl.float32)
            w = ((plus_16 - 1.0) * 16.0 - zero) * scale
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
        else:
            x_plus_16 = tl.dot(x, plus_16.to(x.dtype), input_precision=PRECISION)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            group_offset = (tile * BLOCK_K) // GROUP_SIZE * stride_sg  # groups * N: far below 2^31
            scale = tl.load(Scales + group_offset + cols, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(Zeros + group_offset + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += x_plus_16 * (16.0 * scale)[None, :] - x_sum[:, None] * ((16.0 + zero) * scale)[None, :]
    offsets = rows[:, None] * stride_om + cols[None, :]
    store_split(acc, Out, Partial, offsets, stride_os, row_ok[:, None] & col_ok[None, :], Counters, SPLIT)


@triton.jit
def _w4a16_tiled_kernel(
    X, QWeight, Scales, Zeros, GIdx, Out, Partial, Counters,
    M, N, K,
    stride_xm, stride_qk, stride_sg, stride_os, stride_om, group_size,
    HAS_G_IDX: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block of rows, block of output columns, K split): K tiles `split, split + SPLIT_K, ...`; the output
    as in `_w4a16_fma_kernel`."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    shifts = ((tl.arange(0, BLOCK_K) % 8) * 4)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        packed = tl.load(QWeight + (ks // 8)[:, None].to(tl.int64) * stride_qk + cols[None, :], mask=w_mask, other=0)
        q = ((packed >> shifts) & 0xF).to(tl.float32)
        if HAS_G_IDX:
            groups = tl.load(GIdx + ks, mask=k_ok, other=0).to(tl.int64)
            offsets = groups[:, None] * stride_sg + cols[None, :]
            scale = tl.load(Scales + offsets, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(Zeros + offsets, mask=w_mask, other=0.0).to(tl.float32)
        else:
            offsets = (k_start // group_size).to(tl.int64) * stride_sg + cols
            scale = tl.load(Scales + offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(Zeros + offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w = ((q - zero) * scale).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    offsets = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    store_split(acc, Out, Partial, offsets, stride_os, row_ok[:, None] & col_ok[None, :], Counters, SPLIT_K > 1)


@triton.jit
def _w4a16_dequantize_kernel(
    QWeight, Scales, Zeros, GIdx, Out, N, K, stride_qk, stride_sg, stride_ok, group_size,
    HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (block of K, block of N): `Out[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]`, W's transpose,
    laid out as `qweight` is (N contiguous), so that loads and stores both run along N."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    packed = tl.load(QWeight + (ks // 8)[:, None].to(tl.int64) * stride_qk + cols[None, :], mask=mask, other=0)
    q = ((packed >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    if HAS_G_IDX:
        groups = tl.load(GIdx + ks, mask=ks < K, other=0).to(tl.int64)
    else:
        groups = (ks // group_size).to(tl.int64)
    offsets = groups[:, None] * stride_sg + cols[None, :]
    scale = tl.load(Scales + offsets, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(Zeros + offsets, mask=mask, other=0.0).to(tl.float32)
    w = (q - zero) * scale
    tl.store(Out + ks[:, None].to(tl.int64) * stride_ok + cols[None, :], w.to(Out.dtype.element_ty), mask=mask)


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     g_idx: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weight's transpose `W.T [K, N]` in `dtype`, dequantized as the GEMMs read it (see `w4a16_gemm`)."""
    k, n = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 128))
    _w4a16_dequantize_kernel[grid](qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, n, k,
                                   qweight.stride(0), scales.stride(0), out.stride(0), group_size,
                                   HAS_G_IDX=g_idx is not None, BLOCK_K=64, BLOCK_N=128)
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: Optional[torch.Tensor] = None,
    config: Union[SkinnyConfig, W4A16Config, None] = None,
) -> torch.Tensor:
    """`x [M, K] @ W.T -> [M, N]` in x's dtype, for `qweight [K / 8, N]` int32, `scales` and `zeros` `[groups, N]`
    (zeros in the unsigned 4-bit domain, any float dtype), `g_idx [K]` int32 or None (see the module docstring).
    `config` picks the kernel (a `SkinnyConfig` needs M <= SKINNY_MAX_ROWS); by default the rows decide, and a 16-bit
    call of `DEQUANTIZE_FROM_ROWS` rows or more multiplies the dequantized weight on cuBLAS."""
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.dtype == torch.int32 and qweight.shape[0] * PACK_FACTOR == k, (qweight.shape, x.shape)
    assert scales.shape == zeros.shape and scales.shape[1] == n and scales.stride(1) == 1 and zeros.stride(1) == 1
    if config is None and m >= DEQUANTIZE_FROM_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return x @ w4a16_dequantize(qweight, scales, zeros, group_size, g_idx, x.dtype)
    x = x.contiguous()
    if config is None:
        pick = skinny_config if m <= SKINNY_MAX_ROWS else w4a16_config
        config = pick(m, n, k, group_size, g_idx is not None, num_sms(x.device))
    fma = isinstance(config, SkinnyConfig) and not config.use_dot
    if g_idx is None and (group_size % PACK_FACTOR if fma else group_size % config.block_k):
        raise ValueError(f"W4A16 groups of {group_size} do not fit the kernel's K tile of {config.block_k}: a tile "
                         f"on the tensor cores must lie inside one group, a word of 8 features in any")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial, counters = split_buffers(out, config.split_k, m * triton.cdiv(n, config.block_n))
    args = (x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, partial, counters, m, n, k,
            x.stride(0), qweight.stride(0), scales.stride(0), m * n, out.stride(0))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    has_g_idx = g_idx is not None
    if isinstance(config, SkinnyConfig):
        assert m <= SKINNY_MAX_ROWS, f"the skinny W4A16 kernel takes up to {SKINNY_MAX_ROWS} rows, not {m}"
        row_blocks = triton.cdiv(m, 16) if config.use_dot else m
        grid = (row_blocks, triton.cdiv(n, config.block_n), config.split_k)
        kernel = _w4a16_dot_kernel if config.use_dot else _w4a16_fma_kernel
        options = dict(PRECISION=precision, BLOCK_M=16) if config.use_dot else dict(EVEN_K=k % config.block_k == 0)
        kernel[grid](*args, HAS_G_IDX=has_g_idx, GROUP_SIZE=group_size, SPLIT=config.split_k > 1,
                     BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                     num_stages=config.num_stages, **options, **launch_options(x))
    else:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
        _w4a16_tiled_kernel[grid](*args, group_size, HAS_G_IDX=has_g_idx, SPLIT_K=config.split_k,
                                  PRECISION=precision, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                                  BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
