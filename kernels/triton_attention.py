"""Paged attention in Triton: decode (split-KV, the splits merged in the same launch) and extend (prefix + causal
new tokens).

Both kernels read keys and values straight from the per-layer KV buffers `[slots, kv_heads, head_dim]`
through `req_to_token[row, position] = slot`, one slot per token, so they work for any page size and any
slot layout. Softmax runs in float32 with base-2 exponentials (the scale is pre-multiplied by log2(e)).

Contract shared by both entry points: the new tokens' K/V have already been written to the buffers at
their slots (decode can write them itself: `new_kv`), and `req_to_token` maps every position `< seq_len` of each
request to a valid slot. With a sliding `window` W, the query at position t sees only the keys at positions
t - W < p <= t, and only the positions some query of the request sees need a valid slot: no other is read.

On a machine without CUDA these kernels run only under the Triton interpreter, which must be switched on
(`TRITON_INTERPRET=1`) before `triton` is first imported in the process.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.kv_store import copy_token_kv
from radixserve.kernels.pdl import launch_options, wait_previous
from radixserve.kernels.split_k import last_to_arrive, split_counters

_LOG2_E = 1.0 / math.log(2.0)
_NO_WINDOW = 1 << 30


@triton.jit
def _decode_split_kernel(
    Q, K_buffer, V_buffer, Req_to_token, Req_pool_indices, Seq_lens, Partial_out, Partial_lse, Slot_map,
    Out, Sinks, Counters, New_k, New_v, New_loc,
    scale_log2, window,
    stride_q_token, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_r2t_row,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    stride_o_token, stride_o_head,
    stride_nk_token, stride_nk_head, stride_nv_token, stride_nv_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MAP_SLOTS: tl.constexpr, HAS_SINKS: tl.constexpr, STORE_NEW: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = (request, kv head, split): the GROUP query heads sharing that kv head attend over
    one contiguous share of the request's positions. Writes normalized partial outputs and their
    base-2 log-sum-exp; an empty share writes lse = -inf so the reduction ignores it. With MAP_SLOTS, a slot s of
    req_to_token is read at Slot_map[s] (a window layer's own slot space). The program that finishes last of its
    (request, kv head) merges the shares into Out, so a call is one launch (kernels/split_k.py's `last_to_arrive`).

    With STORE_NEW, the request's new token's K and V (rows of New_k / New_v) are written here, at slot New_loc[req],
    rather than by a launch before this one: by the program whose share holds the last position, the only one that
    reads that slot, before its CTA barrier and its first read of the buffers."""
    wait_previous(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row = tl.load(Req_pool_indices + req).to(tl.int64)
    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    first = tl.maximum(seq_len - window, 0)  # the window's first position
    split_len = (seq_len - first + NUM_SPLITS - 1) // NUM_SPLITS
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    if STORE_NEW:
        if (seq_len - 1 - first) // split_len == split:
            copy_token_kv(New_k, New_v, K_buffer, V_buffer, req.to(tl.int64), tl.load(New_loc + req).to(tl.int64),
                          kv_head, offs_d, dim_mask, stride_nk_token, stride_nk_head, stride_nv_token, stride_nv_head,
                          stride_k_slot, stride_k_head, stride_v_slot, stride_v_head)
            tl.debug_barrier()  # the CTA's own stores are visible to all of its threads' loads after it
    q_heads = kv_head * GROUP + offs_h
    q = tl.load(
        Q + req * stride_q_token + q_heads[:, None] * stride_q_head + offs_d[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for block_start in range(start, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        key_mask = offs_n < end
        slots = tl.load(Req_to_token + row * stride_r2t_row + offs_n, mask=key_mask, other=0).to(tl.int64)
        if MAP_SLOTS:
            slots = tl.load(Slot_map + slots, mask=key_mask, other=0).to(tl.int64)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(K_buffer + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # Every block inside [start, end) holds at least one real key, so new_max is finite.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(V_buffer + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    has_keys = row_sum > 0
    safe_sum = tl.where(has_keys, row_sum, 1.0)
    lse = tl.where(has_keys, row_max + tl.log2(safe_sum), float("-inf"))
    out_base = Partial_out + req * stride_po_req + q_heads[:, None] * stride_po_head + split * stride_po_split
    tl.store(out_base + offs_d[None, :], acc / safe_sum[:, None], mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(Partial_lse + req * stride_pl_req + q_heads * stride_pl_head + split, lse, mask=head_mask)
    counter = Counters + req * tl.num_programs(1) + kv_head
    if last_to_arrive(counter, NUM_SPLITS):
        _merge_shares(Partial_out, Partial_lse, Out, Sinks, req, q_heads, head_mask, offs_d, dim_mask,
                      stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
                      stride_o_token, stride_o_head, NUM_SPLITS, HAS_SINKS)
        tl.store(counter, 0)  # for the next call


@triton.jit
def _merge_shares(Partial_out, Partial_lse, Out, Sinks, req, q_heads, head_mask, offs_d, dim_mask,
                  stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
                  stride_o_token, stride_o_head, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Out for `q_heads` of request `req`: the shares' outputs weighted by their softmax mass, exp2(lse - max lse), in
    split order (read from L2: other programs wrote them). With HAS_SINKS, each head's sink logit (natural log) joins
    the denominator with no value."""
    lse_base = Partial_lse + req * stride_pl_req + q_heads * stride_pl_head
    max_lse = tl.full(q_heads.shape, float("-inf"), dtype=tl.float32)
    for split in range(NUM_SPLITS):
        max_lse = tl.maximum(max_lse, tl.load(lse_base + split, mask=head_mask, other=0.0, cache_modifier=".cg"))
    total = tl.zeros(q_heads.shape, dtype=tl.float32)
    acc = tl.zeros((q_heads.shape[0], offs_d.shape[0]), dtype=tl.float32)
    out_base = Partial_out + req * stride_po_req + q_heads[:, None] * stride_po_head + offs_d[None, :]
    mask = head_mask[:, None] & dim_mask[None, :]
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(lse_base + split, mask=head_mask, other=0.0, cache_modifier=".cg") - max_lse)
        acc += tl.load(out_base + split * stride_po_split, mask=mask, other=0.0, cache_modifier=".cg") * weight[:, None]
        total += weight
    if HAS_SINKS:
        sink = tl.load(Sinks + q_heads, mask=head_mask, other=0.0).to(tl.float32)
        total += tl.exp2(sink * 1.4426950408889634 - max_lse)  # sink * log2(e)
    tl.store(Out + req * stride_o_token + q_heads[:, None] * stride_o_head + offs_d[None, :],
             (acc / total[:, None]).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _extend_kernel(
    Q, K_buffer, V_buffer, Out, Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Extend_starts, Sinks,
    scale_log2, window,
    stride_q_token, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_o_token, stride_o_head,
    stride_r2t_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program = (request, query head, block of BLOCK_M new tokens). New token i of a request sits
    at position prefix_len + i and attends to positions prefix_len + i - window < p <= prefix_len + i (its
    prefix, then the new tokens causally), all read from the KV buffers through req_to_token. With HAS_SINKS, the
    head's sink logit (natural log) joins every row's denominator with no value."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)

    extend_len = tl.load(Extend_lens + req).to(tl.int32)
    if block_m * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(Prefix_lens + req).to(tl.int32)
    token_start = tl.load(Extend_starts + req).to(tl.int64)
    row = tl.load(Req_pool_indices + req).to(tl.int64)
    kv_head = head // GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    query_mask = offs_m < extend_len
    dim_mask = offs_d < HEAD_DIM
    tokens = token_start + offs_m
    q = tl.load(Q + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=query_mask[:, None] & dim_mask[None, :], other=0.0)
    query_pos = prefix_len + offs_m

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The last query of this block sees keys up to its own position; nothing beyond is loaded.
    kv_end = prefix_len + tl.minimum((block_m + 1) * BLOCK_M, extend_len)
    # The first query of this block sees nothing before its window.
    kv_start = tl.maximum(prefix_len + block_m * BLOCK_M - window + 1, 0)
    for block_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        key_mask = offs_n < kv_end
        slots = tl.load(Req_to_token + row * stride_r2t_row + offs_n, mask=key_mask, other=0).to(tl.int64)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(K_buffer + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = key_mask[None, :] & (offs_n[None, :] <= query_pos[:, None]) & (
            offs_n[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # A row whose window starts past this block has seen no key yet: its max stays -inf, and a finite stand-in
        # keeps exp2(-inf - -inf) out of its sums.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(V_buffer + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    if HAS_SINKS:  # exp2(sink - row_max) in the running max's frame; every real row has seen a key (row_max finite)
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # in base 2, as the scores: * log2(e)
        row_sum += tl.exp2(sink - tl.where(row_max == float("-inf"), sink, row_max))
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(Out + tokens[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=query_mask[:, None] & dim_mask[None, :])


def _window_arg(window: Optional[int]) -> int:
    """The kernels' window: full attention is a window longer than any sequence (an int32 the kernels compare)."""
    if window is None:
        return _NO_WINDOW
    if window < 1:
        raise ValueError(f"a sliding window must hold at least one position, got {window}")
    return min(window, _NO_WINDOW)


def _check_sinks(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, "sinks: float32 [num_heads]"
    return sinks.contiguous()


def _dot_precision(dtype: torch.dtype):
    # float32 models (the CPU-parity checks) need exact float32 products, not TF32; 16-bit inputs keep
    # Triton's default.
    return "ieee" if dtype == torch.float32 else None


def _check_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dim() == 3 and out.shape == q.shape, "q and out must be [num_tokens, num_heads, head_dim]"
    assert k_buffer.dim() == 3 and v_buffer.shape == k_buffer.shape, "KV buffers: [slots, kv_heads, head_dim]"
    assert q.shape[1] % k_buffer.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.shape[2] == k_buffer.shape[2], "q and KV head_dim differ"
    for t in (q, k_buffer, v_buffer, out):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    assert k_buffer.dtype == v_buffer.dtype, "the K and V buffers must share a dtype"
    assert q.dtype == k_buffer.dtype or k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2), \
        "q and KV buffers must share a dtype, or the KV buffers hold float8 (read as q's dtype)"
    if not q.is_cuda and q.dtype == torch.bfloat16:
        # Triton's CPU interpreter (numpy) has no bfloat16: its dot products come out as garbage.
        raise NotImplementedError("bfloat16 Triton attention needs a GPU; use float16 or float32 on the CPU")


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    num_kv_splits: int,
    window: Optional[int] = None,
    slot_map: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    block_n: int = 32,
    num_warps: int = 4,
    new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Decode attention: one query token per request attends to all `seq_lens[i]` positions of its row (the last
    `window` of them with a sliding window). With `slot_map` (int64), the KV of slot s is read at `slot_map[s]`.
With `sinks` (float32 `[num_heads]`), each head's sink logit joins its softmax's denominator (gpt-oss).

    `new_kv = (k, v, loc)`: the requests' new tokens' K and V `[batch, num_kv_heads, head_dim]` (last dimension
    contiguous), written here at slots `loc [batch]` (cast to the buffers' dtype) instead of before the call: what
    kernels/kv_store.py's `store_kv` would write, in this launch. Each `loc[i]` must be the slot `req_to_token` maps
    request i's last position to (the new token's); not with `slot_map`.

    q, out: `[batch, num_heads, head_dim]`; partial_out: float32 `[>=batch, num_heads, >=num_kv_splits,
    head_dim]` and partial_lse: float32 `[>=batch, num_heads, >=num_kv_splits]` are scratch. Every
    `seq_lens[i] >= 1`. Returns `out`. `block_n` keys a step and `num_warps` are the kernel's tile and warps
    (benchmarks/decode_attention_gpu.py times them).
    """
    _check_layout(q, k_buffer, v_buffer, out)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert partial_out.shape[0] >= batch and partial_out.shape[2] >= num_kv_splits
    assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    sinks_arg = partial_lse if sinks is None else _check_sinks(sinks, num_heads)
    counters = split_counters(q.device, batch * num_kv_heads)
    if new_kv is not None:
        new_k, new_v, new_loc = new_kv
        assert slot_map is None, "new_kv is written at req_to_token's slots: not with a slot_map"
        assert new_k.shape == new_v.shape == (batch, num_kv_heads, head_dim) and new_loc.shape == (batch,)
        assert new_k.stride(-1) == new_v.stride(-1) == 1
    else:
        new_k = new_v = q  # never read without STORE_NEW
        new_loc = seq_lens
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, partial_out, partial_lse,
        req_to_token if slot_map is None else slot_map, out, sinks_arg, counters, new_k, new_v, new_loc,
        sm_scale * _LOG2_E, _window_arg(window),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), MAP_SLOTS=slot_map is not None, HAS_SINKS=sinks is not None,
        STORE_NEW=new_kv is not None, num_warps=num_warps, **launch_options(q),
    )
    return out


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Extend (prefill) attention over each request's cached prefix plus its new tokens, causally (within the
    last `window` positions of each query with a sliding window); with `sinks` (float32 `[num_heads]`), each head's
    sink logit joins its softmax's denominator (gpt-oss).

    q, out: `[num_new_tokens, num_heads, head_dim]`, the new tokens of all requests concatenated in
    request order; `extend_starts[i]` is request i's first row in q. `max_extend_len` (a host int) sizes
    the grid. Returns `out`.
    """
    _check_layout(q, k_buffer, v_buffer, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buffer.shape[1]
    batch = int(req_pool_indices.shape[0])
    if batch == 0 or max_extend_len == 0:
        return out
    # Small tiles keep the CPU interpreter quick; the GPU wants tiles that fill its tensor cores, halved
    # for float32 so the pipelined K/V tiles stay within shared memory.
    block = (64 if q.element_size() <= 2 else 32) if q.is_cuda else 16
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        extend_starts if sinks is None else _check_sinks(sinks, num_heads), sm_scale * _LOG2_E, _window_arg(window),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype), HAS_SINKS=sinks is not None,
    )
    return out
