"""kernels/cpu_gguf_linear.cpp (`torch.ops.radixserve_cpu.gguf_linear`, `gguf_dequantize`) against float64 references.

Weights are quantized with gguf-py (`gguf.quants.quantize`, the file format's own reference code) and dequantized by it
for the references. The kernel dequantizes the blocks in registers and multiplies with float32 activations, so it
agrees with the float64 product of the dequantized weight to float32 rounding (sums in another order), and its
dequantization equals gguf-py's exactly.

The K-quants (Q4_K, Q5_K, Q6_K; blocks packed by tests/gguf_kquants.py, dequantized by gguf-py) are multiplied in
integers as llama.cpp does, on activations rounded per block of 256 to int8 (llama.cpp's Q8_K) or 14-bit integers:
against the float64 product of the dequantized weight with those rounded activations (rebuilt here) they agree to
float32 rounding, and against the float activations to the rounding of the activations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gguf_kquants import KQUANT_TYPES, quantize_kquant
from radixserve.kernels import cpu_build

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
# (rows M, out features N, in features K): one decode row; a few; a prefill; N not a multiple of the tile rows;
# the embedded model's shapes
SHAPES = [(1, 64, 96), (3, 50, 64), (5, 33, 160), (37, 130, 256), (1, 576, 1536), (9, 3072, 576)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def quantized_weight(ggml_type, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [n, row bytes] uint8, the dequantized values [n, k] float64)."""
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = quantize(values, ggml_type)
    return torch.from_numpy(np.array(blocks, copy=True)), torch.from_numpy(dequantize(blocks, ggml_type)).double()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_references(ggml_type, shape):
    m, n, k = shape
    blocks, weight = quantized_weight(ggml_type, n, k, seed=m + n + k)
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    out = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(ggml_type), bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)

    reference = x.double() @ weight.T + bias.double()
    assert ((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5
    assert torch.equal(torch.ops.radixserve_cpu.gguf_dequantize(blocks, int(ggml_type)).double(), weight)


# (rows M, out features N, in features K), K whole super-blocks: decode rows, a few, prefill rows, N not a multiple of
# the kernel's 4-row tiles, a long K
KQUANT_SHAPES = [(1, 64, 256), (3, 50, 512), (16, 33, 256), (77, 130, 768), (1, 576, 1536), (128, 96, 2048)]


LEVELS = {8: 127, 16: 8191}  # activation bits -> the largest integer an activation rounds to


def rounded_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's rounding of `x [M, K]`, as float64: per block of 256, xq = round(x / dx), dx = max|x| / levels
    (int8: llama.cpp's Q8_K)."""
    blocks = x.reshape(x.shape[0], -1, 256)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / LEVELS[bits]
    q = torch.where(dx == 0, 0.0, blocks / dx).round().clamp(-LEVELS[bits], LEVELS[bits])
    return (q.double() * dx.double()).reshape(x.shape)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("ggml_type", KQUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", KQUANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kquants_match_float64_references(ggml_type, shape, bits):
    m, n, k = shape
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(m + n + k)).numpy()
    packed = quantize_kquant(values, ggml_type)
    blocks = torch.from_numpy(packed)
    weight = torch.from_numpy(dequantize(packed, ggml_type)).double()
    assert (weight - torch.from_numpy(values).double()).abs().mean() < 0.1  # real blocks of these values
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4  # rows of other scales
    bias = torch.randn(n, generator=generator)
    out = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(ggml_type), bias, bits)
    assert out.dtype == torch.float32 and out.shape == (m, n)

    reference = rounded_activations(x, bits) @ weight.T + bias.double()
    assert ((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5
    float_reference = x.double() @ weight.T + bias.double()
    error = (out.double() - float_reference).abs().max() / float_reference.abs().max()
    assert error < (2e-2 if bits == 8 else 5e-4)
    assert torch.equal(torch.ops.radixserve_cpu.gguf_dequantize(blocks, int(ggml_type)).double(), weight)


def test_kquant_extreme_blocks():
    """Blocks at the ends of every range: the largest scales, q = 0 and q = max, zero activation blocks, constant
    activation blocks (every xq at its largest): the integer sums must neither saturate nor overflow."""
    values = np.zeros((8, 512), dtype=np.float32)
    values[0], values[1, :256], values[2] = 1.0, -1.0, np.linspace(-3, 5, 512)
    values[3, ::2], values[4, 1::3] = 100.0, -100.0
    x = torch.zeros(3, 512)
    x[0] = 7.0
    x[1, :256] = -2.0
    x[1, 256:] = torch.linspace(-1, 1, 256)
    for ggml_type in KQUANT_TYPES:
        packed = quantize_kquant(values, ggml_type)
        weight = torch.from_numpy(dequantize(packed, ggml_type)).double()
        for bits in (8, 16):
            out = torch.ops.radixserve_cpu.gguf_linear(x, torch.from_numpy(packed), int(ggml_type), None, bits)
            reference = rounded_activations(x, bits) @ weight.T
            assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-3), (ggml_type.name, bits)
            assert torch.equal(out[2], torch.zeros(8))


def test_leading_dimensions_zero_rows_and_no_bias():
    blocks, weight = quantized_weight(GGMLQuantizationType.Q4_1, 40, 64, seed=1)
    x = torch.randn(2, 3, 64)
    out = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(GGMLQuantizationType.Q4_1), None)
    flat = torch.ops.radixserve_cpu.gguf_linear(x.reshape(6, 64), blocks, int(GGMLQuantizationType.Q4_1), None)
    assert out.shape == (2, 3, 40) and torch.equal(out.reshape(6, 40), flat)
    empty = torch.ops.radixserve_cpu.gguf_linear(torch.empty(0, 64), blocks, int(GGMLQuantizationType.Q4_1), None)
    assert empty.shape == (0, 40)


def test_a_zero_activation_block_gives_the_bias():
    blocks, _ = quantized_weight(GGMLQuantizationType.Q4_0, 8, 64, seed=2)
    bias = torch.arange(8, dtype=torch.float32)
    out = torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q4_0), bias)
    assert torch.equal(out[0], bias)


def test_bad_input_is_refused_with_the_reason():
    blocks, _ = quantized_weight(GGMLQuantizationType.Q8_0, 8, 64, seed=3)
    q8 = int(GGMLQuantizationType.Q8_0)
    with pytest.raises(RuntimeError, match="last dimension must be 64"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 32), blocks, q8, None)
    with pytest.raises(RuntimeError, match="float32 activations"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64, dtype=torch.bfloat16), blocks, q8, None)
    with pytest.raises(RuntimeError, match="unsupported GGML type 11"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64), blocks, 11, None)
    with pytest.raises(RuntimeError, match="not whole blocks of 20"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q4_1), None)
    q4k = torch.from_numpy(quantize_kquant(np.ones((4, 256), dtype=np.float32), GGMLQuantizationType.Q4_K))
    with pytest.raises(RuntimeError, match="not whole blocks of 176"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 256), q4k, int(GGMLQuantizationType.Q5_K), None)
    with pytest.raises(RuntimeError, match="activation_bits is 8 or 16, got 4"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 256), q4k, int(GGMLQuantizationType.Q4_K), None, 4)
    with pytest.raises(RuntimeError, match="last dimension must be 256"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 32), q4k, int(GGMLQuantizationType.Q4_K), None)


def rounded_blocks_of_32(x: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's rounding of `x [M, K]` (llama.cpp's Q8_0 / Q8_1), as float64: per block of 32,
    xq = round(x / dx), dx = max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(dx == 0, 0.0, blocks / dx).round().clamp(-127, 127)
    return (q.double() * dx.double()).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_activations_match_float64_references(ggml_type, shape):
    """activation_bits 8 on the 32-value blocks: integer dot products of the weights with the activations rounded to
    int8 per block, equal to the float64 product of the dequantized weight with those rounded activations."""
    m, n, k = shape
    blocks, weight = quantized_weight(ggml_type, n, k, seed=m + n + k)
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4  # rows of other scales
    bias = torch.randn(n, generator=generator)
    out = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(ggml_type), bias, 8)
    assert out.dtype == torch.float32 and out.shape == (m, n)

    reference = rounded_blocks_of_32(x) @ weight.T + bias.double()
    assert ((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5
    float_reference = x.double() @ weight.T + bias.double()
    assert ((out.double() - float_reference).abs().max() / float_reference.abs().max()) < 2e-2


def test_int8_activations_on_extreme_blocks():
    """Blocks at the ends of every range, written byte by byte: Q8_0 values -128 and 127 (the sign trick's ends),
    nibbles 0 and 15, negative Q4_1 offsets; activation blocks of zeros, of one constant (every xq at 127) and of a
    single non-zero value. The integer sums must neither saturate nor overflow."""
    k, n = 128, 6
    generator = torch.Generator().manual_seed(5)
    rows = {2: 18, 3: 20, 8: 34}  # type -> block bytes
    x = torch.zeros(3, k)
    x[0] = 3.0
    x[1, :32] = -1.5
    x[1, 40] = 2.0
    x[1, 64:] = torch.linspace(-5, 5, 64)
    for ggml_type, size in rows.items():
        raw = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=generator)
        scales = torch.tensor([0.5, -0.25, 1.0, 2.0], dtype=torch.float16)[torch.randint(0, 4, (n, k // 32, 2))]
        raw[..., :4] = scales.view(torch.uint8).reshape(n, k // 32, 4)
        data = raw[..., 4 if ggml_type == 3 else 2:]
        data[0], data[1] = 0xFF, 0x00  # nibbles 15 / Q8_0 -1; nibbles 0 / Q8_0 0
        if ggml_type == 8:
            data[2], data[3] = 0x80, 0x7F  # Q8_0 -128 and 127
        blocks = raw.reshape(n, -1).contiguous()
        weight = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type))).double()
        out = torch.ops.radixserve_cpu.gguf_linear(x, blocks, ggml_type, None, 8)
        reference = rounded_blocks_of_32(x) @ weight.T
        assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-3), ggml_type
        assert torch.equal(out[2], torch.zeros(n))
