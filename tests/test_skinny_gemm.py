"""The skinny Triton GEMM (`x @ W.T` for at most 16 rows, kernels/skinny_gemm.py) against a float64 product.

Without a GPU the kernel runs under the Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1` before
triton is imported) with its one fixed tile configuration; on a GPU the autotuned kernel is also checked in
bfloat16 against cuBLAS's own error, and replayed inside a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radixserve.kernels.skinny_gemm import MAX_ROWS, skinny_gemm  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)


def _max_error_vs_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    return (out.double() - x.double() @ weight.double().T).abs().max().item()


# (rows, N, K): one row and the most rows; N not a multiple of any block; K a multiple of the largest block
# (the unmasked loop) and not of the smallest (the masked tail).
SHAPES = [(1, 64, 256), (MAX_ROWS, 64, 256), (5, 37, 96), (3, 130, 300), (1, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_matches_a_float64_product_as_closely_as_torch(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = _randn(rows, k, dtype=dtype, seed=rows + n)
    weight = _randn(n, k, dtype=dtype, seed=k, scale=k ** -0.5)
    out = skinny_gemm(x, weight)
    assert out.shape == (rows, n) and out.dtype == dtype
    # Both sum float32 products and round once; only the summation order differs.
    torch_error = _max_error_vs_float64(F.linear(x, weight), x, weight)
    ulp = torch.finfo(dtype).eps * max(1.0, out.double().abs().max().item())
    assert _max_error_vs_float64(out, x, weight) <= max(2 * torch_error, ulp) + 1e-6


def test_keeps_the_leading_shape_and_takes_strided_rows() -> None:
    wide = _randn(2, 3, 2 * 96, dtype=torch.float32, seed=1)
    x = wide[..., ::2]  # last dimension strided: copied to contiguous rows
    weight = _randn(40, 96, dtype=torch.float32, seed=2)
    out = skinny_gemm(x, weight)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_refuses_more_rows_than_one_tile_and_mismatched_inputs() -> None:
    weight = _randn(8, 16, dtype=torch.float32, seed=3)
    with pytest.raises(AssertionError, match="at most 16 rows"):
        skinny_gemm(_randn(MAX_ROWS + 1, 16, dtype=torch.float32, seed=4), weight)
    with pytest.raises(AssertionError, match="columns"):
        skinny_gemm(_randn(2, 15, dtype=torch.float32, seed=5), weight)
    with pytest.raises(AssertionError, match="float16"):
        skinny_gemm(_randn(2, 16, dtype=torch.float16, seed=6), weight)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_replays_in_a_cuda_graph() -> None:
    weight = _randn(4096, 4096, dtype=torch.bfloat16, seed=7, scale=4096 ** -0.5)
    x = _randn(4, 4096, dtype=torch.bfloat16, seed=8)
    expected = skinny_gemm(x, weight).clone()  # the autotuner runs here, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm(x, weight)
    x.copy_(x.flip(0))
    graph.replay()
    torch.testing.assert_close(out, expected.flip(0), rtol=0, atol=0)
