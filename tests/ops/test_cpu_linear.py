"""The C++ small-row linear kernel (kernels/cpu_linear.cpp, `torch.ops.radixserve_cpu.small_linear`) against float64
products of the same numbers.

Every tile shape the kernel picks by row count (1, 2, 3-4, 5 and more, passes with a remainder), weight row counts
that leave a partial tile, and inner sizes with a tail shorter than a vector, in float32 and bfloat16, with and
without bias. Bounds: float32 sums are within 1e-5 of the sum of |x_k w_k| (the reference is exact to that); bfloat16
outputs are the float32 sum rounded once, so within half a bfloat16 step of the exact value plus
that float32 error (8 significant bits: half a step is at most 2^-8 of the value).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.kernels import cpu_build


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def small_linear(x, weight, bias=None):
    return torch.ops.radixserve_cpu.small_linear(x, weight, bias)


def check(x: torch.Tensor, weight: torch.Tensor, bias, got: torch.Tensor) -> None:
    """`got` against the float64 product of the same (already rounded) inputs."""
    assert got.dtype == weight.dtype and got.shape == (*x.shape[:-1], weight.shape[0])
    x64, w64 = x.double().reshape(-1, x.shape[-1]), weight.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    error = (got.double().reshape(exact.shape) - exact).abs()
    bound = 1e-5 * magnitude + 1e-30
    if weight.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs() * 1.0001
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


def make(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", list(range(1, 17)) + [23])
def test_every_row_count(dtype, m):
    """Each tile shape and pass remainder, on weight rows that leave a partial tile and an inner size with a tail."""
    for n, k in [(37, 100), (64, 48), (9, 7)]:
        x, weight, _ = make(m, n, k, dtype, seed=m * 1000 + n, bias=False)
        check(x, weight, None, small_linear(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 1, 16), (5, 2, 15), (2, 3, 17), (4, 7, 31), (6, 15, 33),
                                   (12, 17, 1), (16, 5, 130)])
def test_odd_shapes_with_bias(dtype, shape):
    m, n, k = shape
    x, weight, bias = make(m, n, k, dtype, seed=sum(shape), bias=True)
    check(x, weight, bias, small_linear(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 4, 6, 8])
def test_model_shapes(dtype, m):
    """The embedded model's projections (qkv, o, gate_up, down)."""
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        x, weight, _ = make(m, n, k, dtype, seed=n + k + m, bias=False)
        check(x, weight, None, small_linear(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_give_the_same_bits(dtype):
    """Each output is summed by one thread in a fixed order: the thread count changes nothing."""
    x, weight, bias = make(6, 2050, 576, dtype, seed=7, bias=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_linear(x, weight, bias)
        torch.set_num_threads(2)
        two = small_linear(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    check(x, weight, bias, two)


def test_leading_dimensions_strided_input_and_empty():
    x, weight, _ = make(6, 40, 64, torch.float32, seed=3, bias=False)
    batched = x.reshape(2, 3, 64)
    assert small_linear(batched, weight).shape == (2, 3, 40)
    torch.testing.assert_close(small_linear(batched, weight).reshape(6, 40), small_linear(x, weight))
    wide = torch.randn(6, 128)
    strided = wide[:, ::2]  # not contiguous
    check(strided, weight, None, small_linear(strided, weight))
    assert small_linear(torch.empty(0, 64), weight).shape == (0, 40)


def test_bad_input_is_refused():
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="last dimension"):
        small_linear(torch.randn(2, 15), weight)
    with pytest.raises(RuntimeError, match="x is"):
        small_linear(torch.randn(2, 16).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="contiguous"):
        small_linear(torch.randn(2, 16), torch.randn(16, 8).T)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        small_linear(torch.randn(2, 16).double(), weight.double())
    with pytest.raises(RuntimeError, match="bias"):
        small_linear(torch.randn(2, 16), weight, torch.randn(7))
