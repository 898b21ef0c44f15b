"""The C++ elementwise blocks on the CPU (kernels/cpu_elementwise.cpp) against the torch reference, TORCH_OPS.

They round every intermediate as the reference does, so float32 results agree to a few ulp (reduction order and exp
differ) and bfloat16 results to one bfloat16 step at most, on odd shapes and strided inputs.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.layers import TORCH_OPS, RotaryEmbedding, cpu_kernel_ops, ops_for


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # one bfloat16 rounding step apart at most
        torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=1.6e-2)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 96)])
def test_norms(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    ops = cpu_kernel_ops()
    close(ops.rms_norm(x, weight, 1e-5), TORCH_OPS.rms_norm(x, weight, 1e-5))
    (normed, summed), (ref_normed, ref_summed) = ops.add_rms_norm(x, residual, weight, 1e-5), TORCH_OPS.add_rms_norm(
        x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounded add: exact
    close(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (9, 2 * 40), (2, 3, 2 * 64)])
def test_silu_and_mul(dtype, shape):
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    close(cpu_kernel_ops().silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_views(dtype):
    gen = torch.Generator().manual_seed(2)
    rotary = RotaryEmbedding(64, 4096, 10000.0)
    tokens, heads, kv_heads = 37, 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 64, generator=gen).to(dtype)
    q = qkv[:, :heads * 64].view(tokens, heads, 64)  # views into the fused projection, as the model has them
    k = qkv[:, heads * 64:(heads + kv_heads) * 64].view(tokens, kv_heads, 64)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    ours = cpu_kernel_ops().rotary(positions, q, k, rotary.cos, rotary.sin)
    ref = TORCH_OPS.rotary(positions, q, k, rotary.cos, rotary.sin)
    close(ours[0], ref[0])
    close(ours[1], ref[1])


def test_chosen_on_the_cpu_once_loaded():
    assert ops_for(torch.zeros(2)) is cpu_kernel_ops()
    assert ops_for(torch.zeros(2, dtype=torch.bfloat16)) is cpu_kernel_ops()
    assert ops_for(torch.zeros(2, dtype=torch.float64)) is TORCH_OPS


def test_rotary_refuses_a_position_past_its_table():
    rotary = RotaryEmbedding(64, 16, 10000.0)
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_kernel_ops().rotary(torch.tensor([3, 16]), q, k, rotary.cos, rotary.sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_equals_torch_argmax(dtype):
    """Greedy sampling's argmax (kernels/cpu_argmax.cpp): torch.argmax's ids, ties (first), NaN (first NaN), -inf
    rows, lengths with and without a partial vector."""
    gen = torch.Generator().manual_seed(5)
    for vocab in (1, 15, 16, 49152 + 7):
        x = torch.randn(9, vocab, generator=gen).to(dtype)
        if vocab > 1:
            x[1, -1] = x[1].max() + 1  # maximum in the tail
            x[2] = 0.5  # all tied: the first
            x[3, vocab // 2] = float("nan")
            x[4, 0] = float("nan")
            x[4, -1] = float("nan")
            top = x[5].max() + 1
            x[5, [vocab - 1, vocab // 3]] = top  # tied maxima in different lanes
        x[6] = float("-inf")  # a row with no token left
        got = torch.ops.radixserve_cpu.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (vocab, got, x.argmax(dim=-1))
