"""`x @ W.T` for a few rows of `x`, as one Triton kernel that reads the weight once at full bandwidth.

A decode step of a small batch multiplies a handful of activation rows by every weight matrix of the model:
the step's time is the time to stream the weights from memory. cuBLAS picks split-K GEMV kernels for such
shapes, which add a reduction kernel per matrix. This kernel gives each program a block of the weight's
rows (`BLOCK_N` outputs) and walks the whole reduction dimension itself, so one launch writes the result:

- the activation rows (at most `MAX_ROWS`) are padded to one 16-row tile for `tl.dot`, which costs nothing
  here: the work is bound by the weight's bytes, not by the multiply;
- products are summed in float32 and rounded once to the output dtype, as cuBLAS does;
- the tile sizes come from Triton's autotuner, over a few configurations per weight shape (the first call of
  a shape times them; a CUDA-graph capture runs eagerly before it records, see model_runner/cuda_graph.py).

Without CUDA it runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x that one 16-row tensor-core tile holds


def _configs() -> list[triton.Config]:
    sizes = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6), (64, 128, 8, 4), (16, 128, 4, 8)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in sizes]


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program n: outputs [n * BLOCK_N, (n + 1) * BLOCK_N) of every row."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_skinny_gemm_tuned = triton.autotune(configs=_configs(), key=["N", "K"])(_skinny_gemm_kernel)
# The interpreter cannot time configurations: without CUDA the kernel runs with this one.
INTERPRETER_CONFIG = dict(BLOCK_N=16, BLOCK_K=128)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for `x` of shape `[..., K]` with at most `MAX_ROWS` rows in all and `weight` `[N, K]`
    (contiguous rows), both of one floating dtype; returns `[..., N]` in that dtype."""
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} columns, the weight {k}"
    assert x.dtype == weight.dtype, f"x is {x.dtype}, the weight {weight.dtype}"
    assert weight.stride(1) == 1, "the weight's rows must be contiguous"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    assert m <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        # EVEN_K: every configuration's BLOCK_K (128 to 512) divides K.
        # float32 products stay float32 (no TF32), as torch's matmuls by default.
        common = (rows, weight, out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0))
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        if x.is_cuda:
            _skinny_gemm_tuned[grid](*common, EVEN_K=k % 512 == 0, PRECISION=precision)
        else:
            _skinny_gemm_kernel[grid](*common, EVEN_K=k % 128 == 0, PRECISION=precision, **INTERPRETER_CONFIG)
    return out.view(*x.shape[:-1], n)
