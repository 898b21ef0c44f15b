"""The fused MoE's decode path: a few (token, slot) pairs, matrix-vector products on the CUDA cores.

`fused_moe` (kernels/fused_moe_triton.py) runs this path up to `DECODE_MAX_PAIRS` pairs: no sorting, no padding, the
pair's expert read straight from `topk_ids`, and matrix-vector products on the CUDA cores, each program streaming rows
of one expert's weights with the reduced dimension contiguous (coalesced loads of `w13 [E, 2I, H]` and `w2 [E, H, I]`):

1. `_decode_gate_up_kernel`: per pair and `BLOCK_N` intermediate columns, the expert's `[BLOCK_N, H]` gate and up
   rows times the token's row, then the activation, stored as the pair's row of `[T * top_k, I]`;
2. `_decode_down_kernel`: per token and `DOWN_BLOCK_N` hidden columns, the sum over the token's `top_k` slots of
   the routing weight times the expert's down rows times the slot's activations (plus the weighted down bias), in
   float32, stored once as the token's row of the output. Every slot's rows stream together, `DOWN_BLOCK_K` of the
   intermediate dimension at a time. Each output element is summed by one program in a fixed order: no atomics, and
   the same result every run.

The experts' formats (FP8, 4-bit integers, MXFP4: `ExpertScales`) and the pieces both paths share are
kernels/fused_moe_experts.py's; `_quantized_gate_up` (FP8) and `_packed_gate_up` (packed 4-bit codes) here are the
decode path's gate/up products on them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_moe_configs import BlockConfig
from radixserve.kernels.pdl import launch_options, wait_previous
from radixserve.kernels.fused_moe_experts import (ExpertScales, _activate, _code_values, _scale_values, expert_call,
                                                  scale_groups, weight_strides)


@triton.jit
def _quantized_gate_up(x_row, gate_rows, up_rows, S, gate_scales, up_scales, hidden, col_ok, stride_wk, stride_sk,
                       BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr, SCALE_K: tl.constexpr):
    """The FP8 gate and up rows (`[BLOCK_N, 1]` pointers; their scales' offsets `[BLOCK_N]`) times the token's row
    `x_row`, summed over H: `[BLOCK_N]` float32 each. Each step streams `GROUPS` chunks of `GROUP_K` features, a
    `[BLOCK_N, GROUPS, GROUP_K]` tile whose chunks each meet one scale per row, so a step stays as wide as the 16-bit
    path's however small the scale blocks are."""
    groups = tl.arange(0, GROUPS)
    js = tl.arange(0, GROUP_K)
    gate = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    gate_rows, up_rows = gate_rows[:, :, None], up_rows[:, :, None]
    for k0 in range(0, hidden, GROUPS * GROUP_K):
        starts = k0 + groups * GROUP_K
        features = starts[:, None] + js[None, :]
        k_ok = features < hidden
        x = tl.load(x_row + features, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        w_mask = col_ok[:, None, None] & k_ok[None, :, :]
        scale_at = (starts // SCALE_K)[None, :] * stride_sk
        scale_mask = col_ok[:, None] & (starts < hidden)[None, :]
        gate_scale = tl.load(S + gate_scales[:, None] + scale_at, mask=scale_mask, other=0.0).to(tl.float32)
        up_scale = tl.load(S + up_scales[:, None] + scale_at, mask=scale_mask, other=0.0).to(tl.float32)
        gate_w = tl.load(gate_rows + features[None, :, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32)
        up_w = tl.load(up_rows + features[None, :, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32)
        gate += gate_w * (x * gate_scale[:, :, None])
        up += up_w * (x * up_scale[:, :, None])
    return tl.sum(tl.sum(gate, axis=2), axis=1), tl.sum(tl.sum(up, axis=2), axis=1)


@triton.jit
def _packed_gate_up(x_row, gate_rows, up_rows, S, Z, gate_scales, up_scales, hidden, col_ok, stride_wk, stride_sk,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, FP4: tl.constexpr):
    """`_quantized_gate_up` for packed 4-bit rows (`[BLOCK_N, 1]` pointers to each row's words): a step loads
    `[BLOCK_N, BLOCK_K / 8]` words once and multiplies each of their eight codes by the activations it meets
    (features `8 * word + j`: a strided read, from cache), the sums kept per word until its scale applies (and for
    4-bit integers its zero point: `x . (q - z) = x . q - z * sum(x)`)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    words = tl.arange(0, WORDS)
    num_words = hidden // 8
    gate = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for w0 in range(0, num_words, WORDS):
        word_rows = w0 + words
        word_ok = word_rows < num_words
        mask = col_ok[:, None] & word_ok[None, :]
        gate_words = tl.load(gate_rows + word_rows[None, :] * stride_wk, mask=mask, other=0)
        up_words = tl.load(up_rows + word_rows[None, :] * stride_wk, mask=mask, other=0)
        gate_dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        up_dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_row + word_rows * 8 + j, mask=word_ok, other=0.0).to(tl.float32)
            gate_dot += x[None, :] * _code_values((gate_words >> (4 * j)) & 0xF, FP4)
            up_dot += x[None, :] * _code_values((up_words >> (4 * j)) & 0xF, FP4)
            if not FP4:  # the zero points' share below
                x_sum += x
        scale_at = ((word_rows * 8) // SCALE_K * stride_sk)[None, :]
        gate_at, up_at = gate_scales[:, None] + scale_at, up_scales[:, None] + scale_at
        if not FP4:
            gate_dot -= x_sum[None, :] * tl.load(Z + gate_at, mask=mask, other=0.0).to(tl.float32)
            up_dot -= x_sum[None, :] * tl.load(Z + up_at, mask=mask, other=0.0).to(tl.float32)
        gate += gate_dot * _scale_values(tl.load(S + gate_at, mask=mask, other=0), FP4)
        up += up_dot * _scale_values(tl.load(S + up_at, mask=mask, other=0), FP4)
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _decode_gate_up_kernel(
    X, W13, B13, S13, Z13, Inter, TopkWeights, TopkIds,
    top_k, hidden, intermediate, swiglu_alpha, swiglu_limit, up_scale_row,
    stride_x, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk, stride_inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, INT4: tl.constexpr, FP4: tl.constexpr,
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (pair, block of intermediate columns): the expert's `[BLOCK_N, H]` gate and up rows, streamed in
    `BLOCK_K` chunks along H, times the token's row. The products accumulate elementwise in float32 tiles and are
    reduced over K once, after the loop. A pair of routing weight 0 stores nothing (the down kernel skips it). With
    HAS_SCALE, quantized rows: FP8 (`_quantized_gate_up`: their scales `S13`, up's from scale row `up_scale_row`), or
    with INT4 packed 4-bit codes (`_packed_gate_up`: integers less their zero points `Z13`, laid out as the scales;
    with FP4, MXFP4's e2m1 values and exponent scales)."""
    wait_previous(USE_PDL)
    pair = tl.program_id(0)
    if tl.load(TopkWeights + pair) == 0.0:
        return
    expert = tl.load(TopkIds + pair).to(tl.int64)
    token = (pair // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    gate_rows = W13 + expert * stride_we + cols[:, None] * stride_wn
    if HAS_SCALE:
        gate_scales = expert * stride_se + (cols // SCALE_N) * stride_sn
        up_rows, up_scales = gate_rows + intermediate * stride_wn, gate_scales + up_scale_row * stride_sn
        if INT4:
            gate_sum, up_sum = _packed_gate_up(X + token * stride_x, gate_rows, up_rows, S13, Z13, gate_scales,
                                               up_scales, hidden, col_ok, stride_wk, stride_sk, BLOCK_N, BLOCK_K,
                                               SCALE_K, FP4)
        else:
            gate_sum, up_sum = _quantized_gate_up(X + token * stride_x, gate_rows, up_rows, S13, gate_scales,
                                                  up_scales, hidden, col_ok, stride_wk, stride_sk, BLOCK_N, GROUPS,
                                                  GROUP_K, SCALE_K)
    else:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + token * stride_x + ks
        gate_ptrs = gate_rows + ks[None, :] * stride_wk
        up_ptrs = gate_ptrs + intermediate * stride_wn
        gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = k0 + ks < hidden
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
            gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
            up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        gate_sum = tl.sum(gate, axis=1)
        up_sum = tl.sum(up, axis=1)
    if HAS_BIAS:
        bias_ptrs = B13 + expert * stride_be + cols
        gate_sum += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        up_sum += tl.load(bias_ptrs + intermediate, mask=col_ok, other=0.0).to(tl.float32)
    activated = _activate(gate_sum, up_sum, swiglu_alpha, swiglu_limit, CLAMPED_SWIGLU)
    tl.store(Inter + pair.to(tl.int64) * stride_inter + cols, activated.to(Inter.dtype.element_ty), mask=col_ok)


@triton.jit
def _decode_down_kernel(
    Inter, W2, B2, S2, Z2, Out, TopkWeights, TopkIds,
    hidden, intermediate,
    stride_inter, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk, stride_out,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, INT4: tl.constexpr, FP4: tl.constexpr,
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (token, block of hidden columns): the sum over the token's slots of the routing weight times the
    expert's `[BLOCK_N, I]` down rows times the slot's activations (and times its down bias, with HAS_BIAS). Each
    iteration loads one `BLOCK_K` chunk of every slot at once, a `[SLOTS, BLOCK_N, BLOCK_K]` tile (`SLOTS`: `TOP_K`
    rounded up to a power of two), so the loads of all the token's experts are in flight together; the per-slot sums
    are weighted and added once, after the loop. Slots of weight 0 read nothing. With HAS_SCALE, an FP8 chunk is
    `GROUPS` runs of `GROUP_K` features, each run's sums scaled by the rows' scale for it (`S2`) before they join the
    slot's; with INT4, packed 4-bit rows step `BLOCK_K / 8` words at a time as `_packed_gate_up` does (integers less
    their zero points `Z2`, or with FP4 MXFP4's e2m1 values)."""
    wait_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    slots = tl.arange(0, SLOTS)
    pairs = token * TOP_K + slots
    slot_ok = slots < TOP_K
    experts = tl.load(TopkIds + pairs, mask=slot_ok, other=0).to(tl.int64)
    weights = tl.load(TopkWeights + pairs, mask=slot_ok, other=0.0)
    live = slot_ok & (weights != 0.0)  # a slot of weight 0 has nothing to read
    w_rows = W2 + experts[:, None, None] * stride_we + cols[None, :, None] * stride_wn
    rows_ok = live[:, None, None] & col_ok[None, :, None]
    per_slot = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    if HAS_SCALE and INT4:  # packed 4-bit codes, each word loaded once (see `_packed_gate_up`)
        WORDS: tl.constexpr = BLOCK_K // 8
        words = tl.arange(0, WORDS)
        num_words = intermediate // 8
        scale_rows = experts[:, None, None] * stride_se + (cols // SCALE_N)[None, :, None] * stride_sn
        for w0 in range(0, num_words, WORDS):
            word_rows = w0 + words
            word_ok = word_rows < num_words
            mask = rows_ok & word_ok[None, None, :]  # [SLOTS, BLOCK_N, WORDS]
            packed_words = tl.load(w_rows + word_rows[None, None, :] * stride_wk, mask=mask, other=0)
            dot = tl.zeros((SLOTS, BLOCK_N, WORDS), dtype=tl.float32)
            a_sum = tl.zeros((SLOTS, WORDS), dtype=tl.float32)
            for j in tl.static_range(8):
                a = tl.load(Inter + pairs[:, None] * stride_inter + (word_rows * 8 + j)[None, :],
                            mask=live[:, None] & word_ok[None, :], other=0.0).to(tl.float32)
                dot += a[:, None, :] * _code_values((packed_words >> (4 * j)) & 0xF, FP4)
                if not FP4:  # the zero points' share below
                    a_sum += a
            scale_at = scale_rows + ((word_rows * 8) // SCALE_K * stride_sk)[None, None, :]
            if not FP4:
                dot -= a_sum[:, None, :] * tl.load(Z2 + scale_at, mask=mask, other=0.0).to(tl.float32)
            per_slot += tl.sum(dot * _scale_values(tl.load(S2 + scale_at, mask=mask, other=0), FP4), axis=2)
    elif HAS_SCALE:
        groups = tl.arange(0, GROUPS)
        js = tl.arange(0, GROUP_K)
        scales = experts[:, None, None] * stride_se + (cols // SCALE_N)[None, :, None] * stride_sn
        scale_ok = live[:, None, None] & col_ok[None, :, None]
        for k0 in range(0, intermediate, GROUPS * GROUP_K):
            starts = k0 + groups * GROUP_K
            features = starts[:, None] + js[None, :]  # [GROUPS, GROUP_K]
            k_ok = features < intermediate
            a = tl.load(Inter + pairs[:, None, None] * stride_inter + features[None, :, :],
                        mask=live[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
            w_mask = rows_ok[:, :, :, None] & k_ok[None, None, :, :]
            scale_at = scales + (starts // SCALE_K)[None, None, :] * stride_sk  # [SLOTS, BLOCK_N, GROUPS]
            scale_mask = scale_ok & (starts < intermediate)[None, None, :]
            scale = tl.load(S2 + scale_at, mask=scale_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows[:, :, :, None] + features[None, None, :, :] * stride_wk, mask=w_mask,
                        other=0.0).to(tl.float32)
            per_slot += tl.sum(tl.sum(w * a[:, None, :, :], axis=3) * scale, axis=2)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = Inter + pairs[:, None] * stride_inter + ks[None, :]
        w_ptrs = w_rows + ks[None, None, :] * stride_wk
        for k0 in range(0, intermediate, BLOCK_K):
            k_ok = k0 + ks < intermediate
            a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=rows_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
            per_slot += tl.sum(w * a[:, None, :], axis=2)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        per_slot += tl.load(B2 + experts[:, None] * stride_be + cols[None, :], mask=live[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32)
    out = tl.sum(per_slot * weights[:, None], axis=0)
    tl.store(Out + token * stride_out + cols, out.to(Out.dtype.element_ty), mask=col_ok)


def decode(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_weights: torch.Tensor,
           pair_ids: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
           swiglu: Optional[tuple[float, float]], scales: tuple[Optional[ExpertScales], Optional[ExpertScales]],
           config: BlockConfig, out: torch.Tensor) -> None:
    """The decode path of `fused_moe` (module docstring) on `pair_weights`, `pair_ids` `[T * k]`, into `out`."""
    c = expert_call(hidden, w13, w2, pair_ids, w13_bias, swiglu, scales, config)
    w13_scales, w2_scales = scales
    (s13, z13, *s13_strides), (s2, z2, *s2_strides) = c.w13_scales, c.w2_scales
    inter = torch.empty(c.num_pairs, c.intermediate, dtype=hidden.dtype, device=hidden.device)
    _decode_gate_up_kernel[(c.num_pairs, triton.cdiv(c.intermediate, config["BLOCK_N"]))](
        hidden, w13, w13_bias if c.has_bias else w13, s13, z13, inter, pair_weights, pair_ids,
        c.top_k, c.hidden_size, c.intermediate, c.alpha, c.limit, c.up_scale_row,
        hidden.stride(0), *weight_strides(w13, w13_scales), w13_bias.stride(0) if c.has_bias else 0,
        *s13_strides, inter.stride(0),
        BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], HAS_BIAS=c.has_bias, CLAMPED_SWIGLU=swiglu is not None,
        **scale_groups(config["BLOCK_K"], w13_scales, c.hidden_size), **c.w13_consts, **c.launch,
        **launch_options(hidden),
    )
    _decode_down_kernel[(c.num_tokens, triton.cdiv(c.hidden_size, config["DOWN_BLOCK_N"]))](
        inter, w2, w2_bias if c.has_bias else w2, s2, z2, out, pair_weights, pair_ids,
        c.hidden_size, c.intermediate,
        inter.stride(0), *weight_strides(w2, w2_scales), w2_bias.stride(0) if c.has_bias else 0,
        *s2_strides, out.stride(0),
        TOP_K=c.top_k, SLOTS=triton.next_power_of_2(c.top_k), BLOCK_N=config["DOWN_BLOCK_N"],
        BLOCK_K=config["DOWN_BLOCK_K"], HAS_BIAS=c.has_bias,
        **scale_groups(config["DOWN_BLOCK_K"], w2_scales, c.intermediate), **c.w2_consts, **c.launch,
        **launch_options(hidden),
    )
