"""The fused MoE's decode path (a few (token, slot) pairs), the activation both paths share, quantized experts.

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

FP8 experts. The weights may be float8_e4m3fn with float32 scales per block of `(block_n, block_k)` (`ExpertScales`:
128 x 128 in fine-grained checkpoints; `(1, 32)` for gpt-oss's MXFP4 held in FP8; `(1, K)` is one scale per output
row). Both paths load the FP8 weights, so an expert costs one byte a value to read, and apply the scales in
registers. The aligned path narrows its `BLOCK_K` so that a tile never spans two scale blocks, and scales each tile's
partial sums once per output column (its tensor-core product of the bf16-converted FP8 tile, exact since e4m3 fits in
bf16). For FP8 the decode path keeps its `BLOCK_K` wide and splits each step into `GROUPS` runs of `GROUP_K` features,
one scale per row and run (`scale_groups`), so its loads stay as wide as the 16-bit path's; 4-bit experts step one
group at a time, which measured faster. The result is the product with
the dequantized weight `w * scale`, up to summation order.

4-bit experts (AWQ, GPTQ, compressed-tensors W4A16) stay in `Int4Weight`'s layout, eight values a 32-bit word along
the reduced features, with a scale and a zero point per group of `block_k` features and output column. Each word is
loaded once: the aligned path widens a tile of words to their values by a broadcast shift (`_packed_tile`), multiplies
them, exact in bf16, on the tensor cores and corrects each tile's partial sums by the zero points (`(x . q - zero *
sum(x)) * scale`); the decode path multiplies each of a word's eight codes by the activations it meets and applies
the word's scale and zero point to those sums (`_packed_gate_up`; one Qwen3-30B-A3B layer at 1 token took 26.4 us
on an H100 where loading each word once per code took 39.7). Half a byte a value: Qwen3-30B-A3B's experts in about
15 GB.

MXFP4 experts (gpt-oss's checkpoints) take the same packing: the words hold OCP e2m1 codes (sign, two exponent bits,
one mantissa bit) instead of unsigned integers, with one e8m0 exponent byte per 32 features and output column (the
scale `2^(e - 127)`) and no zero points (`ExpertScales.fp4`, the kernels' `FP4`). A code becomes its value in
registers by moving its bits under a float16's sign, exponent and mantissa (`_e2m1_values`), exact on both paths:
about 0.53 bytes a value, so gpt-oss-120b's experts take about 61 GB where their FP8 copy takes 129.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_moe_configs import BlockConfig


class ExpertScales(NamedTuple):
    """The scales of quantized experts.

    FP8 (`zeros` None): weights `[E, N, K]` float8_e4m3fn (w13: N = 2I), `scale [E, ceil(N / block_n) (twice for w13:
    gate's rows, then up's), ceil(K / block_k)]` float32, value `w * scale`.

    4-bit (`zeros` given): weights `[E, K / 8, N]` int32, eight consecutive reduced features a word (feature k at bits
    `4 * (k % 8)`: `Int4Weight`'s layout, model_runner/quantization/int4.py), `scale` and `zeros` `[E, K / block_k, N]`
    per group of `block_k` features (`block_n` 1), value `(q - zero) * scale`.

    MXFP4 (`fp4`): weights packed as 4 bits, the codes e2m1; `scale [E, K / 32, N]` uint8 exponents (`block_k` 32,
    `block_n` 1), value `e2m1(code) * 2^(scale - 127)`; no zeros. An exponent of 0 reads as the scale 0 (2^-127 in
    the format: below every bfloat16 product it could join)."""

    scale: torch.Tensor
    block_n: int
    block_k: int
    zeros: Optional[torch.Tensor] = None
    fp4: bool = False

    @property
    def packed(self) -> bool:
        """Whether the weights are 4-bit codes packed eight a 32-bit word (4-bit integers or MXFP4)."""
        return self.zeros is not None or self.fp4


def packed(scales: Optional[ExpertScales]) -> bool:
    """Whether experts with these scales are packed 4-bit codes."""
    return scales is not None and scales.packed


def expert_layout(w13: torch.Tensor, w2: torch.Tensor, scales: Optional[ExpertScales]) -> tuple[int, int, int]:
    """(experts, intermediate, hidden) of stacked expert weights, plain or quantized as `scales` says."""
    if packed(scales):
        return w2.shape[0], w2.shape[1] * 8, w2.shape[2]
    return w2.shape[0], w2.shape[2], w2.shape[1]


def weight_strides(weight: torch.Tensor, scales: Optional[ExpertScales]) -> tuple[int, int, int]:
    """A stacked weight's strides along (expert, output feature, reduced feature; in words for 4-bit experts)."""
    if packed(scales):
        return weight.stride(0), weight.stride(2), weight.stride(1)
    return weight.stride(0), weight.stride(1), weight.stride(2)


def scale_groups(block_k: int, scales: Optional[ExpertScales], reduced: int) -> dict:
    """The FP8 decode kernels' `GROUPS` x `GROUP_K` split of a `block_k` step: runs that each meet one scale per row,
    as many as keep the step `block_k` wide (on an H100 at Qwen3-30B-A3B-FP8's shape, 4.47 -> 4.15 ms a batch-1 step
    against one scale block a step). Packed 4-bit experts step by words and read a scale per word
    (`_packed_gate_up`); the split is unused there."""
    group_k = reduced_tile(block_k, scales, reduced)
    if packed(scales):
        return {"GROUPS": 1, "GROUP_K": group_k}
    return {"GROUPS": block_k // group_k, "GROUP_K": group_k}


def reduced_tile(block_k: int, scales: Optional[ExpertScales], reduced: int) -> int:
    """The `BLOCK_K` a kernel reducing `reduced` features runs with: the config's, narrowed for quantized experts so
    that a tile never spans two scale blocks (a power of two that divides `block_k`, unless one block covers every
    feature)."""
    if scales is None or scales.block_k >= reduced:
        return block_k
    tile = 1 << (min(block_k, scales.block_k).bit_length() - 1)
    while scales.block_k % tile:
        tile //= 2
    return max(tile, 1)


@triton.jit
def _activate(gate, up, swiglu_alpha, swiglu_limit, CLAMPED_SWIGLU: tl.constexpr):
    """`silu(gate) * up` in float32, or gpt-oss's clamped SwiGLU (see `fused_moe`)."""
    if CLAMPED_SWIGLU:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        activated = gate / (1.0 + tl.exp(-swiglu_alpha * gate)) * (up + 1.0)
    else:
        activated = gate / (1.0 + tl.exp(-gate)) * up
    return activated


@triton.jit
def _code_values(codes, FP4: tl.constexpr):
    """float32 values of 4-bit codes (int32, 0..15): their unsigned integers, or with FP4 their e2m1 values."""
    if FP4:
        return _e2m1_values(codes)
    return codes.to(tl.float32)


@triton.jit
def _packed_tile(rows, word0, num_words, stride_wk, col_ok, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 FP4: tl.constexpr):
    """`[BLOCK_K, BLOCK_N]` float32 values of packed 4-bit rows (`rows`: `[1, BLOCK_N]` pointers to each column's
    words) from word row `word0` on: each word loaded once and widened to its eight codes by a broadcast shift
    (feature `8 * word + j` at bits `4 * j`)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word_rows = word0 + tl.arange(0, WORDS)
    words = tl.load(rows + word_rows[:, None] * stride_wk, mask=(word_rows < num_words)[:, None] & col_ok[None, :],
                    other=0)
    codes = (words[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 0xF
    return tl.reshape(_code_values(codes, FP4), (BLOCK_K, BLOCK_N))


@triton.jit
def _e2m1_values(codes):
    """float32 values of e2m1 codes (int32, 0..15): the sign to a float16's sign bit and the three magnitude bits to
    its two lowest exponent bits and its first mantissa bit make `value * 2^-14` (code 1, 0.5, becomes the float16
    subnormal 2^-15), exact, as is the float32 product with 2^14."""
    half_bits = ((codes & 0x8) << 12) | ((codes & 0x7) << 9)
    return half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _scale_values(raw, FP4: tl.constexpr):
    """A loaded tile of scales as float32; with FP4, e8m0 exponent bytes as the power of two `2^(e - 127)` (the byte
    placed in a float32's exponent field; 0 reads as 0)."""
    if FP4:
        return (raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


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
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
):
    """Program (pair, block of intermediate columns): the expert's `[BLOCK_N, H]` gate and up rows, streamed in
    `BLOCK_K` chunks along H, times the token's row. The products accumulate elementwise in float32 tiles and are
    reduced over K once, after the loop. A pair of routing weight 0 stores nothing (the down kernel skips it). With
    HAS_SCALE, quantized rows: FP8 (`_quantized_gate_up`: their scales `S13`, up's from scale row `up_scale_row`), or
    with INT4 packed 4-bit codes (`_packed_gate_up`: integers less their zero points `Z13`, laid out as the scales;
    with FP4, MXFP4's e2m1 values and exponent scales)."""
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
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
):
    """Program (token, block of hidden columns): the sum over the token's slots of the routing weight times the
    expert's `[BLOCK_N, I]` down rows times the slot's activations (and times its down bias, with HAS_BIAS). Each
    iteration loads one `BLOCK_K` chunk of every slot at once, a `[SLOTS, BLOCK_N, BLOCK_K]` tile (`SLOTS`: `TOP_K`
    rounded up to a power of two), so the loads of all the token's experts are in flight together; the per-slot sums
    are weighted and added once, after the loop. Slots of weight 0 read nothing. With HAS_SCALE, an FP8 chunk is
    `GROUPS` runs of `GROUP_K` features, each run's sums scaled by the rows' scale for it (`S2`) before they join the
    slot's; with INT4, packed 4-bit rows step `BLOCK_K / 8` words at a time as `_packed_gate_up` does (integers less
    their zero points `Z2`, or with FP4 MXFP4's e2m1 values)."""
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


def scale_args(scales: Optional[ExpertScales], weight: torch.Tensor) -> tuple:
    """A kernel's scale arguments: the scales and the zero points (the weight stands in for what is absent), their
    strides along (expert, output feature, reduced feature), and the `HAS_SCALE`, `SCALE_N`, `SCALE_K`, `INT4`
    (packed 4-bit codes) and `FP4` (MXFP4's) constants."""
    if scales is None:
        return (weight, weight, 0, 0, 0), {"HAS_SCALE": False, "SCALE_N": 1, "SCALE_K": 1, "INT4": False,
                                           "FP4": False}
    scale, int4 = scales.scale, scales.packed
    strides = (scale.stride(0), scale.stride(2), scale.stride(1)) if int4 else scale.stride()
    zeros = scales.zeros if scales.zeros is not None else scale
    return ((scale, zeros, *strides), {"HAS_SCALE": True, "SCALE_N": scales.block_n, "SCALE_K": scales.block_k,
                                       "INT4": int4, "FP4": scales.fp4})


@dataclass
class ExpertCall:
    """What the launchers of both paths derive from one `fused_moe` call: sizes, launch options, the activation's
    constants, and each weight's scale arguments (`scale_args`)."""

    num_tokens: int
    hidden_size: int
    num_experts: int
    intermediate: int
    num_pairs: int
    top_k: int
    launch: dict
    has_bias: bool
    alpha: float
    limit: float
    w13_scales: tuple  # (scales, zeros, stride_e, stride_n, stride_k)
    w13_consts: dict
    w2_scales: tuple
    w2_consts: dict
    up_scale_row: int  # w13's first scale row of up


def expert_call(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_ids: torch.Tensor,
                w13_bias: Optional[torch.Tensor], swiglu: Optional[tuple[float, float]],
                scales: tuple[Optional[ExpertScales], Optional[ExpertScales]], config: BlockConfig) -> ExpertCall:
    num_tokens, hidden_size = hidden.shape
    w13_scales, w2_scales = scales
    num_experts, intermediate, _ = expert_layout(w13, w2, w2_scales)
    num_pairs = pair_ids.numel()
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    w13_args, w13_consts = scale_args(w13_scales, w13)
    w2_args, w2_consts = scale_args(w2_scales, w2)
    return ExpertCall(num_tokens, hidden_size, num_experts, intermediate, num_pairs, num_pairs // num_tokens,
                      {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}, w13_bias is not None,
                      float(alpha), float(limit), w13_args, w13_consts, w2_args, w2_consts,
                      triton.cdiv(intermediate, w13_scales.block_n) if w13_scales is not None else 0)


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
    )
    _decode_down_kernel[(c.num_tokens, triton.cdiv(c.hidden_size, config["DOWN_BLOCK_N"]))](
        inter, w2, w2_bias if c.has_bias else w2, s2, z2, out, pair_weights, pair_ids,
        c.hidden_size, c.intermediate,
        inter.stride(0), *weight_strides(w2, w2_scales), w2_bias.stride(0) if c.has_bias else 0,
        *s2_strides, out.stride(0),
        TOP_K=c.top_k, SLOTS=triton.next_power_of_2(c.top_k), BLOCK_N=config["DOWN_BLOCK_N"],
        BLOCK_K=config["DOWN_BLOCK_K"], HAS_BIAS=c.has_bias,
        **scale_groups(config["DOWN_BLOCK_K"], w2_scales, c.intermediate), **c.w2_consts, **c.launch,
    )
