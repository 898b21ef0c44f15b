"""kernels/cpu_gguf_linear.cpp (`torch.ops.radixserve_cpu.gguf_linear`, `gguf_dequantize`) against float64 references.

Weights are quantized with gguf-py (`gguf.quants.quantize`, the file format's own reference code) and dequantized by it
for the references. The kernel dequantizes the blocks in registers and multiplies with float32 activations, so it
agrees with the float64 product of the dequantized weight to float32 rounding (sums in another order), and its
dequantization equals gguf-py's exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

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
    with pytest.raises(RuntimeError, match="unsupported GGML type 12"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64), blocks, 12, None)
    with pytest.raises(RuntimeError, match="not whole blocks of 20"):
        torch.ops.radixserve_cpu.gguf_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q4_1), None)
