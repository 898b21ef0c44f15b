"""Dynamic FP8 quantization of activations in one Triton launch: per row, or per row and group of features.

`q[m, k] = round(x[m, k] / s)` saturated to e4m3's +-448, `s = max(amax / 448, 1e-12)` over row m (or over its group
of `group` features), scales stored in float32. In torch the same takes six elementwise launches per projection, which
at decode cost more than the product itself; here one program handles one row (or one group of one row). Shapes
depend only on x's, so a call can be captured in a CUDA graph. Without CUDA the kernel runs only under the Triton
interpreter (`TRITON_INTERPRET=1` set before `triton` is imported).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _quantize_kernel(X, Q, Scale, K, stride_x, stride_q, num_groups,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
    """Program (row, group); GROUP == BLOCK spans the whole row when there is one group."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (cols < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE-rounded divisions (a plain `/` compiles to an approximate one on the GPU): the scales and values equal
    # the torch definition's bit for bit.
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX_), MIN_SCALE_)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row * num_groups + group, scale)


def quantize_fp8(x: torch.Tensor, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` to float8_e4m3fn with float32 scales `[M, 1]` (per row) or `[M, ceil(K / group)]`."""
    m, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    group_size = k if group is None else group
    num_groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, num_groups)](x, q, scale, k, x.stride(0), q.stride(0), num_groups, GROUP=group_size,
                                          BLOCK=triton.next_power_of_2(group_size), FP8_MAX_=FP8_MAX,
                                          MIN_SCALE_=MIN_SCALE, num_warps=4 if group_size <= 1024 else 8)
    return q, scale
