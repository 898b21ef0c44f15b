"""W4A16 GEMM in Triton: 16-bit activations times 4-bit grouped weights, dequantized in registers.

`out[M, N] = x[M, K] @ W.T` with `W[n, k] = (q[n, k] - zeros[g(k), n]) * scales[g(k), n]`, where `q` holds unsigned
4-bit values packed eight along K into int32 words, `qweight[K / 8, N]` (value `k` in bits `4 * (k % 8)` of word
`k // 8`), and `g(k)` is the group of input feature `k`: `k // group_size`, or `g_idx[k]` for GPTQ's act-order
checkpoints, whose groups are not contiguous runs of K. Each program dequantizes its `[BLOCK_K, BLOCK_N]` tile of the
weight in registers (shift, mask, subtract, multiply, in float32) and multiplies it with the activations' tile in the
activations' dtype, accumulating in float32: the weight crosses memory once, at half a byte per value.

Few rows (decode) split K over `SPLIT_K` programs per output tile, which add their partial sums into a float32 buffer,
so a skinny product still spreads over every SM. Shapes depend only on (M, N, K), so a call can be captured in a CUDA
graph. float32 activations multiply in IEEE float32. Without CUDA the kernel runs only under the Triton interpreter
(`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

PACK_FACTOR = 8  # 4-bit values per int32 word


class W4A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def w4a16_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool, num_sms: int) -> W4A16Config:
    """Tile sizes for an (m, n, k) product. Without `g_idx`, a K tile lies in one group (`block_k` divides
    `group_size`), so the program loads one row of scales per tile."""
    block_k = 128 if has_g_idx else min(128, group_size)
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 3
    else:  # K tiles of 64: at 128 the three stages of 128 x 128 tiles need 257 KiB of shared memory (H100: 227 KiB)
        block_m, block_n, warps, stages = 128, 128, 8, 3
        block_k = 64 if has_g_idx else min(64, group_size)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k * 2 <= k_tiles // 4 and split_k < 16:
        split_k *= 2
    return W4A16Config(block_m, block_n, block_k, split_k, warps, stages)


@triton.jit
def _w4a16_kernel(
    X, QWeight, Scales, Zeros, GIdx, Out,
    M, N, K, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    HAS_G_IDX: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block of rows, block of output columns, K split)."""
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
    out_offsets = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(Out + out_offsets, acc.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(Out + out_offsets, acc, mask=out_mask)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: Optional[torch.Tensor] = None,
    config: Optional[W4A16Config] = None,
) -> torch.Tensor:
    """`x [M, K] @ W.T -> [M, N]` in x's dtype, for `qweight [K / 8, N]` int32, `scales` and `zeros` `[groups, N]`
    (zeros in the unsigned 4-bit domain, any float dtype), `g_idx [K]` int32 or None (see the module docstring)."""
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.dtype == torch.int32 and qweight.shape[0] * PACK_FACTOR == k, (qweight.shape, x.shape)
    assert scales.shape == zeros.shape and scales.shape[1] == n and scales.stride(1) == 1 and zeros.stride(1) == 1
    x = x.contiguous()
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        config = w4a16_config(m, n, k, group_size, g_idx is not None, num_sms)
    if g_idx is None:
        assert group_size % config.block_k == 0, "a K tile must lie inside one group"
    if config.split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        m, n, k, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        HAS_G_IDX=g_idx is not None, SPLIT_K=config.split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out if config.split_k == 1 else out.to(x.dtype)
