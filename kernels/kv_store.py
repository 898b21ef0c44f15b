"""Writes the new tokens' K and V into one layer's KV buffers with a single Triton kernel.

`k_buffer[loc[t]] = k[t]` and `v_buffer[loc[t]] = v[t]` for every token t, cast to the buffers' dtype. The
torch path (`buffer[loc] = values`) is one indexed-scatter kernel per buffer, each slower than a plain copy;
this is one launch per layer, reading k and v in place from strided views (e.g. slices of a fused qkv).

The launch shape depends only on the tensor shapes, so it can be captured in a CUDA graph. Without CUDA it
runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.pdl import launch_options, wait_previous


@triton.jit
def _store_kv_kernel(
    Loc, K, V, K_buffer, V_buffer,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: all heads of its K and of its V."""
    wait_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    copy_token_kv(K, V, K_buffer, V_buffer, token, slot, heads, dims, mask,
                  stride_k_token, stride_k_head, stride_v_token, stride_v_head,
                  stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head)


@triton.jit
def copy_token_kv(K, V, K_buffer, V_buffer, token, slot, heads, dims, mask,
                  stride_k_token, stride_k_head, stride_v_token, stride_v_head,
                  stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head):
    """Row `token` of K and V, at head offsets `heads` and feature offsets `dims` (broadcast together, `mask` over
    their shape), to slot `slot` of the buffers, cast to the buffers' dtype. Also the decode attention kernel's write of
    a request's new K/V (kernels/triton_attention.py)."""
    k = tl.load(K + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    v = tl.load(V + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    tl.store(K_buffer + slot * stride_kb_slot + heads * stride_kb_head + dims,
             k.to(K_buffer.dtype.element_ty), mask=mask)
    tl.store(V_buffer + slot * stride_vb_slot + heads * stride_vb_head + dims,
             v.to(V_buffer.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write `k, v [T, kv_heads, head_dim]` at slots `loc [T]` (int32 or int64, each a valid row of the
    buffers; not checked on the device) of `k_buffer, v_buffer [slots, kv_heads, head_dim]`. Slots should be
    distinct; where they repeat (padding rows all aimed at the dummy slot) which token's values land there is
    unspecified, as with an indexed write. Every tensor needs a contiguous last dimension."""
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and loc.shape == (num_tokens,)
    assert k_buffer.shape[1:] == (num_heads, head_dim) and v_buffer.shape == k_buffer.shape
    assert k.stride(-1) == v.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == 1
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        loc, k, v, k_buffer, v_buffer,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8, **launch_options(k),
    )
