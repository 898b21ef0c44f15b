"""bfloat16 linear layers on AMX tiles (kernels/cpu_amx_linear.cpp), for the CPU's packed linears: decode batches of
2 to 128 rows and prefill steps of 256 rows and more.

Decode batches feed a few dozen rows through each projection, and on a 2-core machine reading the weight is what a
step costs; the decode loop (`amx_linear`) reads each weight tile once per 32 rows. Measured on a 2-core AMX machine,
2 threads (`python benchmarks/cpu_linear.py --threads 2 --rows 1 4 8 32 64 128 256 --dtypes bfloat16`: the 120
projections of SmolLM2-135M, 30 layers' weights in turn so they stream from memory, in ms; record
docs/results/cpu_vs_vllm_amx/cpu_linear_amx.json): against oneDNN's packed weights 8 rows 16.9 -> 15.7, 32 rows
20.4 -> 13.8, 64 rows 24.5 -> 19.4, 128 rows 32.6 -> 32.6; against the small-row kernel (kernels/cpu_linear.cpp)
4 rows 16.3 -> 13.2, one row 14.8 -> 14.2 but the LM head 1.63 -> 1.79, so one row stays on that kernel.

Prefill steps (a chunk of up to 512 tokens) are bound by the tile products instead; the prefill loop (`amx_gemm`)
keeps a slice of 32 input rows in L1 while the weight's column panels stream past, and measured faster than both
oneDNN paths (the packed inner product, and `F.linear` for o and down) from `GEMM_MIN_ROWS` on (`python
benchmarks/cpu_linear.py --threads 2 --rows 256 512 1024 --dtypes bfloat16 --paths packed F.linear amx gemm`;
figures in docs/benchmarks/history/cpu.md, "bfloat16 prefill linears on AMX tiles"). From 129 to 255 rows the packed oneDNN
weight stays (the decode loop falls behind it there, the prefill loop ties it).

`AmxWeight` holds the weight packed into the tiles' pair layout, made at the first call that can use it (the kernel
library loads in the background) and only where the CPU and the OS grant the tiles (`RADIXSERVE_CPU_AMX=0` keeps
oneDNN; `RADIXSERVE_CPU_AMX_GEMM=0` keeps only the prefill row counts on oneDNN). The copy adds the weights' size
once more; `extra_copy_fits` (model_runner/cpu_small_batch.py) is the same memory rule as for the float32 packed
copies.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from radixserve.kernels import cpu_build

MIN_ROWS = 2
MAX_ROWS = 128
GEMM_MIN_ROWS = 256


def pack_for_tiles(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` as `[N / 16, K / 32, 16, 16, 2]`: element (nb, kb, r, n, e) = weight[16 nb + n, 32 kb + 2 r + e]
    (the B operand of TDPBF16PS: 16 rows of K pairs by 16 columns)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def shape_supported(weight: torch.Tensor) -> bool:
    """The kernel takes 32 output columns and 32 of K at a time."""
    return weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0


def gemm_enabled() -> bool:
    """Whether prefill row counts run the prefill loop (`RADIXSERVE_CPU_AMX_GEMM=0`: oneDNN as before it)."""
    return os.environ.get("RADIXSERVE_CPU_AMX_GEMM", "1") != "0"


class AmxWeight:
    """A linear's weight for the AMX kernel: packed at the first call that finds the kernel usable; `linear`
    returns None (the caller's other path) outside `[MIN_ROWS, MAX_ROWS]` and below `GEMM_MIN_ROWS`, or where the
    kernel cannot run."""

    def __init__(self, weight: torch.Tensor, enabled: bool = True) -> None:
        self.weight = weight
        self.usable: Optional[bool] = None if enabled and shape_supported(weight) else False
        self.packed: Optional[torch.Tensor] = None
        self.gemm_min_rows = GEMM_MIN_ROWS if gemm_enabled() else None

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.usable is False:
            return None
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        prefill = self.gemm_min_rows is not None and rows >= self.gemm_min_rows
        if not prefill and not MIN_ROWS <= rows <= MAX_ROWS:
            return None
        if self.usable is None:
            if not cpu_build.ready():
                return None
            self.usable = bool(torch.ops.radixserve_cpu.amx_linear_ready())
            if not self.usable:
                return None
            self.packed = pack_for_tiles(self.weight)
        if prefill:
            return torch.ops.radixserve_cpu.amx_gemm(x, self.packed, bias)
        return torch.ops.radixserve_cpu.amx_linear(x, self.packed, bias)
