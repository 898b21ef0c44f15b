"""RMSNorm, and residual add + RMSNorm, each as one Triton kernel.

The arithmetic mirrors the torch reference in `model_runner/layers.py` (Hugging Face's): the residual sum is
rounded to the activation dtype before it is normalized, the statistics run in float32, the normalized row is
rounded to the activation dtype and only then multiplied by the weight. The torch path needs eight or nine
kernels per norm (the casts to float32 and back, the square, the mean, the rsqrt, two products); here it is one
launch that reads each row once.

Launch shape depends only on the tensor shapes and no value is read back to the host, so both entry points
can be captured in a CUDA graph. On a machine without CUDA the kernel runs only under the Triton interpreter
(`TRITON_INTERPRET=1` set before `triton` is first imported).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.pdl import launch_options, wait_previous

# Rows up to this many elements are normalized from registers in one pass; longer rows take two passes
# over memory (sum of squares, then normalize), so any hidden size works.
MAX_SINGLE_PASS = 16384


@triton.jit
def residual_sum(x, residual, act_dtype):
    """`x + residual` rounded to the activation dtype (the residual stream's dtype), returned in float32."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(act_dtype).to(tl.float32)


@triton.jit
def scaled_norm(x32, rstd, weight32, act_dtype):
    """`x32 * rstd` rounded to the activation dtype, then times the float32 weight: the torch reference's order of
    roundings. The caller rounds the product to its output dtype."""
    return (x32 * rstd).to(act_dtype).to(tl.float32) * weight32


@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, Residual_out,
    stride_x_row, stride_r_row, stride_out_row, stride_ro_row,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, SINGLE_PASS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per row. With HAS_RESIDUAL the normalized value is `x + residual` (rounded to the
    activation dtype), which is also written to Residual_out."""
    wait_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x_row
    r_row = Residual + row * stride_r_row
    out_row = Out + row * stride_out_row
    ro_row = Residual_out + row * stride_ro_row
    act_dtype = X.dtype.element_ty

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x32 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x32 = residual_sum(x32, tl.load(r_row + cols, mask=mask, other=0.0), act_dtype)
            tl.store(ro_row + cols, x32.to(act_dtype), mask=mask)
        rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
        w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, scaled_norm(x32, rstd, w, act_dtype).to(Out.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x32 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x32 = residual_sum(x32, tl.load(r_row + cols, mask=mask, other=0.0), act_dtype)
                tl.store(ro_row + cols, x32.to(act_dtype), mask=mask)
            sum_sq += x32 * x32
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            # Recomputed from the inputs rather than re-read from Residual_out: no program reads memory
            # it wrote itself, whatever the compiler's thread mapping.
            x32 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x32 = residual_sum(x32, tl.load(r_row + cols, mask=mask, other=0.0), act_dtype)
            w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, scaled_norm(x32, rstd, w, act_dtype).to(Out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[rows, cols]` with a contiguous last dimension (a view when the layout allows one)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _launch(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    max_single_pass: int,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,), f"weight shape {tuple(weight.shape)} does not match rows of {n_cols}"
    assert weight.is_contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype"
        r2 = _rows(residual)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s2 = summed.view(-1, n_cols)
    else:
        summed = None
        r2 = s2 = x2  # never read: HAS_RESIDUAL is false
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n_cols)
    single_pass = block <= max_single_pass
    if not single_pass:
        block = triton.next_power_of_2(max_single_pass)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rms_norm_kernel[(num_rows,)](
        x2, r2, weight, out2, s2,
        x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0),
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, SINGLE_PASS=single_pass, BLOCK=block, num_warps=num_warps,
        **launch_options(x2),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, max_single_pass: int = MAX_SINGLE_PASS
             ) -> torch.Tensor:
    """`weight * norm(x)` over the last dimension, as a new tensor of x's shape.

    Output dtype: `torch.promote_types(weight.dtype, x.dtype)`, as the torch reference gives.
    `max_single_pass` (a power of two) bounds the row length normalized in one pass; tests lower it to
    exercise the two-pass path.
    """
    out, _ = _launch(x, None, weight, eps, max_single_pass)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    max_single_pass: int = MAX_SINGLE_PASS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * norm(s), s)` with `s = x + residual` rounded to x's dtype; both are new tensors (the
    inputs are left untouched). x and residual must have the same shape and dtype."""
    out, summed = _launch(x, residual, weight, eps, max_single_pass)
    assert summed is not None
    return out, summed
