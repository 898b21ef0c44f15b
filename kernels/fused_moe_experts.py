"""The experts' formats both paths of the fused MoE read (kernels/fused_moe_triton.py's aligned path,
kernels/fused_moe_decode.py's decode path): their scales (`ExpertScales`), layouts and strides, the Triton helpers
that turn loaded words and scales into values, the shared activation, and the launch arguments one call derives
(`expert_call`).

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
