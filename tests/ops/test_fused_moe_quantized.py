"""Quantized experts in the fused MoE kernels (kernels/fused_moe_experts.py, fused_moe_decode.py, fused_moe_triton.py),
on both paths, against the float64 product of the dequantized weights: FP8 (float8_e4m3fn weights with float32 scales
per block, per output row, or with partial blocks at the ends), 4 bits (`Int4Weight`'s packing, a scale and a zero
point per group) and MXFP4 (e2m1 codes in the same packing, an exponent byte per 32).

Without a GPU they run under the Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`) at tiny shapes; on a
GPU they are compiled and also checked in bfloat16 at Qwen3-30B-A3B's layer shape in 128 x 128 blocks.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixserve.kernels.fused_moe_experts import ExpertScales, reduced_tile  # noqa: E402
from radixserve.kernels.fused_moe_triton import fused_moe  # noqa: E402
from radixserve.model_runner.quantization.fp8 import Fp8Weight  # noqa: E402
from radixserve.model_runner.quantization.int4 import pack_rows  # noqa: E402
from test_fused_moe_kernel import DECODE_CONFIG, routed_with_shared_experts  # noqa: E402
from test_moe_layer import random_experts, reference_experts  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
ALIGNED_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None):
    """Each expert's gate, up and down quantized on its own (`block`, or one scale per row where None), as a
    checkpoint stores them: the FP8 weights, their `ExpertScales`, and the dequantized values."""
    intermediate = w2.shape[2]

    def quantized(weight: torch.Tensor) -> Fp8Weight:
        return Fp8Weight.quantize(weight.float(), block)

    def scale_of(part: Fp8Weight) -> torch.Tensor:
        return part.scale if block is not None else part.scale[:, None]

    w13_q, w13_s, w2_q, w2_s = [], [], [], []
    for e in range(w13.shape[0]):
        gate, up, down = quantized(w13[e, :intermediate]), quantized(w13[e, intermediate:]), quantized(w2[e])
        w13_q.append(torch.cat([gate.weight, up.weight]))
        w13_s.append(torch.cat([scale_of(gate), scale_of(up)]))
        w2_q.append(down.weight)
        w2_s.append(scale_of(down))
    hidden = w13.shape[2]
    w13_block = block or (1, hidden)
    w2_block = block or (1, intermediate)
    w13_scales = ExpertScales(torch.stack(w13_s), *w13_block)
    w2_scales = ExpertScales(torch.stack(w2_s), *w2_block)
    dequantized = (torch.stack([dequantize(q, s, w13_block, intermediate) for q, s in zip(w13_q, w13_s)]),
                   torch.stack([dequantize(q, s, w2_block) for q, s in zip(w2_q, w2_s)]))
    return torch.stack(w13_q), w13_scales, torch.stack(w2_q), w2_scales, dequantized


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               intermediate: int | None = None) -> torch.Tensor:
    """float64 values of one expert's FP8 rows: w13's gate and up scaled each from its own scale rows."""
    if intermediate is not None:
        gate_rows = -(-intermediate // block[0])
        return torch.cat([dequantize(weight[:intermediate], scale[:gate_rows], block),
                          dequantize(weight[intermediate:], scale[gate_rows:], block)])
    n, k = weight.shape
    full = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    if full.shape[1] == 1:
        full = full.expand(n, k)
    return weight.double() * full.double()


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest deviation from the float64 reference, relative to the reference's largest magnitude."""
    return ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def scales_on_device(scales: ExpertScales) -> ExpertScales:
    return scales._replace(scale=scales.scale.to(DEVICE))


# Hidden 64 and intermediate 40 against 16 x 32 blocks: gate's last block is partial (40 = 2.5 blocks of 16), so up's
# scales start on a row of their own; down's 40 reduced features end in a partial block of 32.
@pytest.mark.parametrize("block", [(16, 32), None], ids=["blocks", "per_row"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (9, 8, 2), (33, 16, 4)])
def test_aligned_path_with_fp8_experts_equals_float64(block, num_tokens, num_experts, top_k):
    hidden, intermediate = 64, 40
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32, seed=3)
    w13_q, w13_scales, w2_q, w2_scales, (w13_d, w2_d) = fp8_experts(w13, w2, block)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens)
    out = fused_moe(*on_device(x, w13_q, w2_q, weights, ids), ALIGNED_CONFIG, path="aligned",
                    w13_scales=scales_on_device(w13_scales), w2_scales=scales_on_device(w2_scales))
    expected = reference_experts(x, w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.dtype == torch.float32 and error < 1e-5, error


@pytest.mark.parametrize("block", [(16, 32), (8, 8), None], ids=["blocks", "small_blocks", "per_row"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 8), (3, 2), (8, 2)])
def test_decode_path_with_fp8_experts_equals_float64(block, num_tokens, top_k):
    hidden, intermediate, num_experts = 40, 24, 16
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32, seed=4)
    w13_q, w13_scales, w2_q, w2_scales, (w13_d, w2_d) = fp8_experts(w13, w2, block)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens + top_k)
    config = dict(DECODE_CONFIG, BLOCK_K=32, DOWN_BLOCK_K=32)  # wider than the small blocks: narrowed to fit
    out = fused_moe(*on_device(x, w13_q, w2_q, weights, ids), config, path="decode",
                    w13_scales=scales_on_device(w13_scales), w2_scales=scales_on_device(w2_scales))
    expected = reference_experts(x, w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.shape == (num_tokens, hidden) and error < 1e-5, error


def test_a_tile_never_spans_two_scale_blocks():
    scales = ExpertScales(torch.ones(1, 1, 1), 128, 128)
    assert reduced_tile(256, scales, 2048) == 128 and reduced_tile(64, scales, 2048) == 64
    assert reduced_tile(256, ExpertScales(torch.ones(1, 1, 1), 1, 2048), 2048) == 256  # one block: any tile
    assert reduced_tile(64, ExpertScales(torch.ones(1, 1, 1), 16, 48), 96) == 16  # the largest power of two dividing 48
    assert reduced_tile(256, None, 2048) == 256


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at Qwen3-30B-A3B's layer shape: compiled kernels on a GPU")
@pytest.mark.parametrize("num_tokens,path", [(1, "decode"), (8, "decode"), (64, "aligned"), (512, "aligned")])
def test_bfloat16_fp8_experts_at_qwen3_30b_a3b_shape(num_tokens, path):
    """128 experts of 768, hidden 2048, top-8, 128 x 128 blocks (Qwen3-30B-A3B-FP8's layout), default configs."""
    num_experts, hidden, intermediate, top_k = 128, 2048, 768, 8
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32, seed=5)
    w13_q, w13_scales, w2_q, w2_scales, (w13_d, w2_d) = fp8_experts(w13, w2, (128, 128))
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens)
    out = fused_moe(*on_device(x.bfloat16(), w13_q, w2_q, weights, ids), path=path,
                    w13_scales=scales_on_device(w13_scales), w2_scales=scales_on_device(w2_scales))
    expected = reference_experts(x.bfloat16().float(), w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.dtype == torch.bfloat16 and error < 3e-2, error


def int4_part(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One `[N, K]` projection in 4 bits, asymmetric per group of `group` reduced features: (qweight `[K / 8, N]`,
    scales and zeros `[K / group, N]`, the float64 values `(q - zero) * scale` `[N, K]`)."""
    n, k = weight.shape
    groups = weight.double().view(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    zero = torch.round(-low / scale).clamp(0, 15)
    q = torch.clamp(torch.round(groups / scale[..., None] + zero[..., None]), 0, 15)
    values = ((q - zero[..., None]) * scale[..., None]).view(n, k)
    return pack_rows(q.view(n, k).t().to(torch.int32)), scale.t().float(), zero.t().float(), values


def int4_experts(w13: torch.Tensor, w2: torch.Tensor, group: int):
    """Each expert's gate, up and down in 4 bits: the stacked packed weights `[E, K / 8, N]`, their `ExpertScales`,
    and the dequantized float64 values."""
    intermediate = w2.shape[2]
    parts = {"w13": [], "w2": []}
    for e in range(w13.shape[0]):
        parts["w13"].append([int4_part(w13[e, :intermediate], group), int4_part(w13[e, intermediate:], group)])
        parts["w2"].append([int4_part(w2[e], group)])
    stacked = {}
    for name, per_expert in parts.items():
        q, scale, zero, values = ([torch.cat([p[i] for p in expert], dim=1 if i < 3 else 0) for expert in per_expert]
                                  for i in range(4))
        stacked[name] = (torch.stack(q), ExpertScales(torch.stack(scale), 1, group, torch.stack(zero)),
                         torch.stack(values))
    return stacked["w13"], stacked["w2"]


@pytest.mark.parametrize("path,num_tokens,top_k", [("aligned", 1, 2), ("aligned", 21, 4), ("decode", 1, 8),
                                                   ("decode", 5, 2)])
def test_4bit_experts_equal_float64(path, num_tokens, top_k):
    """Hidden 64 and intermediate 48 in groups of 16 (four and three groups): tiles wider than a group are narrowed,
    and the zero points' share of each tile is taken off."""
    hidden, intermediate, num_experts = 64, 48, 16
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32, seed=6)
    (w13_q, w13_scales, w13_d), (w2_q, w2_scales, w2_d) = int4_experts(w13, w2, group=16)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens + 7)
    config = ALIGNED_CONFIG if path == "aligned" else dict(DECODE_CONFIG, BLOCK_K=32, DOWN_BLOCK_K=32)
    scales = {name: s._replace(scale=s.scale.to(DEVICE), zeros=s.zeros.to(DEVICE))
              for name, s in (("w13_scales", w13_scales), ("w2_scales", w2_scales))}
    out = fused_moe(*on_device(x, w13_q, w2_q, weights, ids), config, path=path, **scales)
    expected = reference_experts(x, w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.shape == (num_tokens, hidden) and error < 1e-5, error


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at Qwen3-30B-A3B's layer shape: compiled kernels on a GPU")
@pytest.mark.parametrize("num_tokens,path", [(1, "decode"), (8, "decode"), (64, "aligned"), (512, "aligned")])
def test_bfloat16_4bit_experts_at_qwen3_30b_a3b_shape(num_tokens, path):
    """128 experts of 768, hidden 2048, top-8, groups of 128 (Qwen3-30B-A3B's GPTQ / AWQ checkpoints), default
    configs."""
    num_experts, hidden, intermediate, top_k = 128, 2048, 768, 8
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32, seed=5)
    (w13_q, w13_scales, w13_d), (w2_q, w2_scales, w2_d) = int4_experts(w13, w2, group=128)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens)
    scales = {name: s._replace(scale=s.scale.to(DEVICE).bfloat16(), zeros=s.zeros.to(DEVICE).bfloat16())
              for name, s in (("w13_scales", w13_scales), ("w2_scales", w2_scales))}
    out = fused_moe(*on_device(x.bfloat16(), w13_q, w2_q, weights, ids), path=path, **scales)
    expected = reference_experts(x.bfloat16().float(), w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.dtype == torch.bfloat16 and error < 3e-2, error


# The e2m1 values of the sixteen codes, written out (sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def fp4_part(n: int, k: int, generator: torch.Generator):
    """One `[N, K]` projection of random MXFP4 codes and exponents (every code, scales 2^-9 .. 2^0): (the packed codes
    `[K / 8, N]` int32, the exponents `[K / 32, N]` uint8, the float64 values `[N, K]`)."""
    codes = torch.randint(0, 16, (n, k), generator=generator)
    exponents = torch.randint(118, 128, (n, k // 32), generator=generator)
    values = E2M1[codes] * torch.exp2(exponents.double() - 127).repeat_interleave(32, dim=1)
    return pack_rows(codes.t()), exponents.t().to(torch.uint8), values


def fp4_experts(num_experts: int, hidden: int, intermediate: int, seed: int):
    """Random MXFP4 experts: for w13 and w2, the stacked packed codes `[E, K / 8, N]`, their `ExpertScales` and the
    float64 values `[E, N, K]`."""
    generator = torch.Generator().manual_seed(seed)
    stacked = []
    for n, k in ((2 * intermediate, hidden), (hidden, intermediate)):
        parts = [fp4_part(n, k, generator) for _ in range(num_experts)]
        codes, exponents, values = (torch.stack([part[i] for part in parts]) for i in range(3))
        stacked.append((codes, ExpertScales(exponents, 1, 32, fp4=True), values))
    return stacked


@pytest.mark.parametrize("path,num_tokens,top_k", [("aligned", 1, 2), ("aligned", 21, 4), ("decode", 1, 4),
                                                   ("decode", 3, 2)])
def test_mxfp4_experts_equal_float64(path, num_tokens, top_k):
    """Hidden 64 and intermediate 96 (two and three blocks of 32): the aligned path narrows its 64-deep tiles to one
    block, the decode path steps 8 words (64 features) at a time, a scale per word (the last step half masked)."""
    hidden, intermediate, num_experts = 64, 96, 8
    (w13_q, w13_scales, w13_d), (w2_q, w2_scales, w2_d) = fp4_experts(num_experts, hidden, intermediate, seed=11)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens + 2)
    config = ALIGNED_CONFIG if path == "aligned" else dict(DECODE_CONFIG, BLOCK_K=64, DOWN_BLOCK_K=64)
    out = fused_moe(*on_device(x, w13_q, w2_q, weights, ids), config, path=path,
                    w13_scales=scales_on_device(w13_scales), w2_scales=scales_on_device(w2_scales))
    expected = reference_experts(x, w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.shape == (num_tokens, hidden) and error < 1e-5, error


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at gpt-oss-20b's layer shape: compiled kernels on a GPU")
@pytest.mark.parametrize("num_tokens,path", [(1, "decode"), (4, "decode"), (64, "aligned"), (512, "aligned")])
def test_bfloat16_mxfp4_experts_at_gpt_oss_20b_shape(num_tokens, path):
    """32 experts of 2880, hidden 2880, top-4 (gpt-oss-20b's experts), default configs."""
    num_experts, hidden, intermediate, top_k = 32, 2880, 2880, 4
    (w13_q, w13_scales, w13_d), (w2_q, w2_scales, w2_d) = fp4_experts(num_experts, hidden, intermediate, seed=12)
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=num_tokens)
    out = fused_moe(*on_device(x.bfloat16(), w13_q, w2_q, weights, ids), path=path,
                    w13_scales=scales_on_device(w13_scales), w2_scales=scales_on_device(w2_scales))
    expected = reference_experts(x.bfloat16().float(), w13_d, w2_d, weights, ids)
    error = relative_error(out, expected)
    assert out.dtype == torch.bfloat16 and error < 3e-2, error
