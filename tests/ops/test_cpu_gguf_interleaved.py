"""Interleaved GGUF blocks (kernels/cpu_gguf_x16.h: `gguf_interleave`, `gguf_linear` on type + 256 for 16-bit
activations, + 512 for int8 ones) against float64 references.

Weights are quantized and dequantized with gguf-py. The kernel rounds each block of 32 activations to 16-bit or 8-bit
integers (`x / dx`, dx = max|x| / 32767 or 127) and multiplies them with the blocks' integers exactly, then scales in
float32. The reference rebuilds that function in float64: the dequantized weight against the rounded activations.
Against it the kernel agrees to float32 rounding; against the unrounded activations, to the rounding of the
activations.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from test_cpu_gguf_linear import kernels, quantized_weight  # noqa: F401 (kernels: the module's autouse fixture)

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
INTERLEAVED = {16: 256, 8: 512}  # activation bits -> the type id's flag
LEVELS = {16: 32767, 8: 127}
BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
# (rows M, out features N, in features K): one decode row, two, three (the kernel's chains per row differ), a pass of
# four and its rest, prefill rows over more than one sweep of 64; the embedded model's shapes
SHAPES = [(1, 16, 32), (2, 48, 96), (3, 32, 160), (9, 64, 256), (70, 48, 64), (1, 960, 576), (5, 576, 1536)]


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [m, k] float32 as the kernel rounds it: per block of 32, dx * round(x / dx), dx = max|x| / LEVELS[bits]."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / float(LEVELS[bits])
    q = torch.where(dx == 0, torch.zeros_like(blocks), torch.round(blocks / dx)).clamp(-LEVELS[bits], LEVELS[bits])
    return (q.double() * dx.double()).reshape(x.shape)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, bits: int) -> torch.Tensor:
    return rounded(x, bits) @ weight.T + bias.double()


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_references(ggml_type, shape, bits):
    m, n, k = shape
    blocks, weight = quantized_weight(ggml_type, n, k, seed=m + n + k)
    interleaved = torch.ops.radixserve_cpu.gguf_interleave(blocks, int(ggml_type), bits)
    assert interleaved.shape == blocks.shape and interleaved.dtype == torch.uint8
    kernel_type = int(ggml_type) + INTERLEAVED[bits]
    assert torch.equal(torch.ops.radixserve_cpu.gguf_dequantize(interleaved, kernel_type).double(), weight)

    generator = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, k, generator=generator).pow(4) * 10  # wide ranges
    bias = torch.randn(n, generator=generator)
    out = torch.ops.radixserve_cpu.gguf_linear(x, interleaved, kernel_type, bias, bits)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    expected = reference(x, weight, bias, bits)
    assert ((out.double() - expected).abs().max() / expected.abs().max()) < 2e-6
    unrounded = x.double() @ weight.T + bias.double()
    assert ((out.double() - unrounded).abs().max() / unrounded.abs().max()) < (2e-4 if bits == 16 else 5e-2)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_row_gives_the_same_bits_in_any_batch(ggml_type, bits):
    """Each output is its row's alone, summed block by block in one order: the kernel is batch invariant."""
    blocks, _ = quantized_weight(ggml_type, 64, 192, seed=3)
    interleaved = torch.ops.radixserve_cpu.gguf_interleave(blocks, int(ggml_type), bits)
    kernel_type = int(ggml_type) + INTERLEAVED[bits]
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(4))
    whole = torch.ops.radixserve_cpu.gguf_linear(x, interleaved, kernel_type, None, bits)
    for start, stop in ((0, 1), (3, 5), (4, 7), (2, 11)):
        part = torch.ops.radixserve_cpu.gguf_linear(x[start:stop], interleaved, kernel_type, None, bits)
        assert torch.equal(part, whole[start:stop]), (start, stop)


@pytest.mark.parametrize("bits", [16, 8])
def test_extreme_blocks_and_a_zero_activation_block(bits):
    """Q8_0's -128 and 127, Q4's 0 and 15, against activations at the rounding's largest level: the integer sums
    stay exact; a block of zero activations adds nothing but the bias."""
    n, k = 32, 64
    for ggml_type in TYPES:
        blocks, weight = quantized_weight(ggml_type, n, k, seed=5)
        raw = blocks.numpy().reshape(n, -1, BLOCK_BYTES[ggml_type])
        values = raw[:, :, BLOCK_BYTES[ggml_type] - (32 if ggml_type == GGMLQuantizationType.Q8_0 else 16):]
        values[0::2] = 0x80 if ggml_type == GGMLQuantizationType.Q8_0 else 0xFF  # -128 / 15 everywhere
        values[1::2] = 0x7F if ggml_type == GGMLQuantizationType.Q8_0 else 0x00  # 127 / 0
        blocks = torch.from_numpy(raw.reshape(n, -1).copy())
        weight = torch.from_numpy(dequantize(blocks.numpy(), ggml_type)).double()
        x = torch.full((2, k), 3.0)
        x[0, 1::2] = -3.0
        x[1, :32] = 0.0
        bias = torch.arange(n, dtype=torch.float32)
        interleaved = torch.ops.radixserve_cpu.gguf_interleave(blocks, int(ggml_type), bits)
        out = torch.ops.radixserve_cpu.gguf_linear(x, interleaved, int(ggml_type) + INTERLEAVED[bits], bias, bits)
        expected = x.double() @ weight.T + bias.double()  # +-3.0 round exactly (dx = 3 / 32767 or 3 / 127)
        assert ((out.double() - expected).abs().max() / expected.abs().max()) < 2e-6, ggml_type.name


def test_bad_input_is_refused_with_the_reason():
    blocks, _ = quantized_weight(GGMLQuantizationType.Q4_1, 40, 64, seed=6)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        torch.ops.radixserve_cpu.gguf_interleave(blocks, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="Q4_0 .2., Q4_1 .3. or Q8_0 .8."):
        torch.ops.radixserve_cpu.gguf_interleave(blocks, int(GGMLQuantizationType.Q4_K))
    blocks, _ = quantized_weight(GGMLQuantizationType.Q4_1, 32, 64, seed=6)
    interleaved = torch.ops.radixserve_cpu.gguf_interleave(blocks, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="interleaved for 16-bit activations, not 8"):
        torch.ops.radixserve_cpu.gguf_linear(torch.randn(1, 64), interleaved, 3 + INTERLEAVED[16], None, 8)
    with pytest.raises(RuntimeError, match="activation_bits is 16 or 8"):
        torch.ops.radixserve_cpu.gguf_interleave(blocks, int(GGMLQuantizationType.Q4_1), 4)
