"""SiLU-and-mul over a fused gate/up projection, as one Triton kernel.

`out = silu(gate) * up` for an input laid out as `[..., 2 * intermediate] = [gate | up]`. As in the torch
reference (`model_runner/layers.py`), silu is computed in float32 and rounded to the activation dtype before
the product, which is rounded again; the torch path spends two kernels (silu, then the product) and an
intermediate tensor on it.

Launch shape depends only on the tensor shapes, so the kernel can be captured in a CUDA graph. Without
CUDA it runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.pdl import launch_options, wait_previous

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    Gate_up, Out,
    stride_in_row, stride_out_row,
    n_cols,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (row, chunk): BLOCK output columns of one row."""
    wait_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    in_row = Gate_up + row * stride_in_row
    gate = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = Out.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    tl.store(Out + row * stride_out_row + cols, (activated * up).to(out_dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` as a new tensor `[..., intermediate]` of gate_up's dtype, where
    `gate_up = [..., 2 * intermediate]` holds `[gate | up]` along its last dimension."""
    width = gate_up.shape[-1]
    assert width % 2 == 0, f"the fused gate/up width {width} must be even"
    n_cols = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows_in = gate_up.reshape(-1, width)
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    rows_out = out.view(-1, n_cols)
    num_rows = rows_in.shape[0]
    if num_rows and n_cols:
        grid = (num_rows, triton.cdiv(n_cols, BLOCK))
        _silu_and_mul_kernel[grid](
            rows_in, rows_out, rows_in.stride(0), rows_out.stride(0), n_cols, BLOCK=BLOCK, num_warps=4,
            **launch_options(rows_in),
        )
    return out
