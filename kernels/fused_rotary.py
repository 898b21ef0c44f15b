"""Neox-style rotary position embedding for q and k, as one Triton kernel.

Each head's two halves `(x1, x2)` become `(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`, the angles read from
float32 cos/sin tables `[max_positions, head_dim // 2]` at each token's position. As in the torch reference
(`model_runner/layers.py`, Hugging Face's arithmetic), the table values are rounded to the activation dtype
and every product and sum is rounded to it too (no fused multiply-adds), so the two paths agree to the last
bit. One launch replaces the torch path's two table gathers, two casts and the fourteen elementwise
kernels of the two rotations.

With `norms` (Qwen3's per-head q and k norms), each head is first normalized as kernels/fused_norm.py normalizes
a row (float32 statistics, the normed value rounded to the activation dtype before the weight product, the product
rounded too) and then rotated, in the same launch: a decoder layer's three launches (q norm, k norm, rotation) become
one, and q and k are read once.

The launch shape depends only on the tensor shapes and positions stay on the device, so the kernel can be
captured in a CUDA graph. Without CUDA it runs only under the Triton interpreter (`TRITON_INTERPRET=1` set
before `triton` is first imported).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_norm import scaled_norm
from radixserve.kernels.pdl import launch_options, wait_previous


@triton.jit
def _rotate_heads(
    X, Out, stride_head, stride_out_head, cos, sin, NormWeight, eps,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rotate the NUM_HEADS heads of one token (X and Out point at the token's first head), each normalized first
    with HAS_NORM."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    mask = (heads < NUM_HEADS)[:, None] & dim_ok[None, :]
    first = X + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(NormWeight + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(NormWeight + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        x1 = scaled_norm(x1, rstd, w1, dtype).to(dtype).to(tl.float32)
        x2 = scaled_norm(x2, rstd, w2, dtype).to(dtype).to(tl.float32)
    # Each product is rounded before the sum, as the torch path's separate kernels round it.
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    out_first = Out + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_first, out1, mask=mask)
    tl.store(out_first + HALF, out2, mask=mask)


@triton.jit
def _rotary_kernel(
    Positions, Cos, Sin, Q, K, Q_out, K_out, QNormWeight, KNormWeight, eps,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head,
    stride_table_row,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: all of its q heads and k heads. A program reads everything it rotates
    before writing it, and tokens never share rows, so the outputs may alias the inputs."""
    wait_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(Positions + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    act_dtype = Q_out.dtype.element_ty
    cos = tl.load(Cos + position * stride_table_row + dims, mask=dim_mask, other=0.0)
    sin = tl.load(Sin + position * stride_table_row + dims, mask=dim_mask, other=0.0)
    cos = cos.to(act_dtype).to(tl.float32)[None, :]
    sin = sin.to(act_dtype).to(tl.float32)[None, :]
    _rotate_heads(Q + token * stride_q_token, Q_out + token * stride_qo_token, stride_q_head, stride_qo_head,
                  cos, sin, QNormWeight, eps, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, HAS_NORM)
    _rotate_heads(K + token * stride_k_token, K_out + token * stride_ko_token, stride_k_head, stride_ko_head,
                  cos, sin, KNormWeight, eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, HAS_NORM)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out_q: Optional[torch.Tensor] = None,
    out_k: Optional[torch.Tensor] = None,
    norms: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q [T, Hq, D]` and `k [T, Hk, D]` by the angles of `positions [T]` (int32 or int64, each
    below the tables' row count; not checked on the device).

    `norms = (q_weight, k_weight, eps)`: each head of q and of k is RMS-normalized over D with that weight `[D]`
    (of q's dtype) before it rotates (see the module docstring).

    `cos`, `sin`: float32 `[max_positions, D // 2]` tables with a contiguous last dimension, on q's device.
    q and k may be strided views (e.g. slices of a fused qkv output) as long as their last dimension is
    contiguous. Results go to `out_q` / `out_k` when given (pass `out_q=q, out_k=k` to rotate in place),
    else to new contiguous tensors. Returns `(out_q, out_k)`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and positions.shape == (num_tokens,)
    assert head_dim % 2 == 0, "rotary embedding needs an even head_dim"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    half = head_dim // 2
    assert cos.shape[-1] == half and cos.shape == sin.shape and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    out_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out_q is None else out_q
    out_k = torch.empty(k.shape, dtype=k.dtype, device=k.device) if out_k is None else out_k
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.dtype == out_k.dtype == q.dtype
    assert out_q.stride(-1) == 1 and out_k.stride(-1) == 1
    if num_tokens == 0:
        return out_q, out_k
    block_half = triton.next_power_of_2(half)
    block_qh = triton.next_power_of_2(num_q_heads)
    block_kh = triton.next_power_of_2(num_k_heads)
    num_warps = 4 if block_qh * block_half <= 2048 else 8
    q_weight, k_weight, eps = norms if norms is not None else (q, k, 0.0)  # the tensors are never read without norms
    if norms is not None:
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.dtype == k_weight.dtype == q.dtype
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    _rotary_kernel[(num_tokens,)](
        positions, cos, sin, q, k, out_q, out_k, q_weight, k_weight, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out_q.stride(0), out_q.stride(1), out_k.stride(0), out_k.stride(1),
        cos.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half, HAS_NORM=norms is not None,
        num_warps=num_warps, **launch_options(q),
        # Left to itself the compiler contracts a product and the following sum into one fused multiply-add,
        # dropping the product's rounding; without that every step rounds as the torch path's kernels do.
        enable_fp_fusion=False,
    )
    return out_q, out_k
