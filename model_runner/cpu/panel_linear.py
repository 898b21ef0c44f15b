"""Linear layers of decode batches on AVX-512 CPUs: the column-panel kernel (kernels/cpu_panel_linear.cpp) on a copy
of the weight packed for it, float32 and (with AVX512_BF16, on CPUs without AMX tiles) bfloat16.

A decode step feeds a few dozen rows through each projection, and every layer's weights stream from memory once a
step. oneDNN's packed inner product spends about a tenth of its time there waiting for the weights, and its tiles
are slower on the narrow projections; the panel kernel prefetches the next column panel while it multiplies the
current one (`benchmarks/cpu_linear.py --hot` against a plain run). Measured on a 2-core AVX-512-BF16 machine
without AMX (AMD EPYC, 2 threads, `python benchmarks/cpu_linear.py --threads 2 --rows ... --paths packed kernel
panel`: the 120 projections of SmolLM2-135M, 30 layers' weights in turn; figures in docs/benchmarks.md).

`PanelWeight` packs when it is made, where the CPU has the instructions (so neither the first request nor a timed
run pays for it), and answers None (the caller's other path) outside its row range, until the kernel library has
loaded (in the background), where the CPU lacks the instructions, or where the shape does not fit (32 output columns
a panel; an even K in bfloat16). `RADIXSERVE_CPU_PANEL_LINEAR=0` keeps every linear off it. The copy adds the
weights' size once more: the callers make one only under the same memory rule as the other packed copies
(`extra_copy_fits`, model_runner/cpu_small_batch.py).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from radixserve.kernels import cpu_build

PANEL = 32
ISA_FLAGS = {torch.float32: "avx512f", torch.bfloat16: "avx512_bf16"}  # what the kernel is compiled for
# Rows (inclusive) for which the panel kernel measured fastest, per weight dtype: (projections, LM head).
# Against the small-row kernel and oneDNN's packed weights, 120 projections (ms): float32 2 rows 17.2 / 28.1 -> 16.1,
# 16 rows 42.5 / 36.3 -> 26.5, 64 rows 100.8 (packed) -> 90.9, 128 rows 176.2 -> 157.1, but 256 rows 284.4 -> 292.7;
# bfloat16 2 rows 9.1 / 14.8 -> 8.2, 16 rows 21.2 (packed) -> 13.3, 64 rows 51.0 -> 43.6, 128 rows 82.0 -> 78.5,
# 256 rows 155.1 -> 190.0. One row ties the small-row kernel, which keeps it. The float32 LM head ties oneDNN's from
# about 48 rows (64 rows: 20.1 against 21.2 ms).
ROWS: dict[torch.dtype, tuple[tuple[int, int], tuple[int, int]]] = {
    torch.float32: ((2, 128), (2, 32)),
    torch.bfloat16: ((2, 128), (2, 64)),
}


def enabled() -> bool:
    return os.environ.get("RADIXSERVE_CPU_PANEL_LINEAR", "1") != "0"


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` as the kernel's panels: float32 `[N / 32, K, 32]`, element (p, k, c) = weight[32 p + c, k];
    bfloat16 `[N / 32, K / 2, 32, 2]`, element (p, j, c, e) = weight[32 p + c, 2 j + e]."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        return w.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return w.view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def shape_supported(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype in ROWS and weight.shape[0] % PANEL == 0
            and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))


class PanelWeight:
    """A linear's weight for the panel kernel, for the row counts of `ROWS` (`head`: the LM head's range)."""

    def __init__(self, weight: torch.Tensor, head: bool = False, enabled_here: bool = True) -> None:
        self.weight = weight
        usable = (enabled_here and enabled() and cpu_build.enabled() and shape_supported(weight)
                  and weight.device.type == "cpu" and cpu_build.has_cpu_flag(ISA_FLAGS[weight.dtype]))
        self.usable: Optional[bool] = None if usable else False  # None: until the library says
        self.rows = ROWS[weight.dtype][1 if head else 0] if usable else (1, 0)
        self.packed = pack_panels(weight) if usable else None

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.usable is False:
            return None
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not self.rows[0] <= rows <= self.rows[1]:
            return None
        if self.usable is None:
            if not cpu_build.ready():
                return None
            self.usable = bool(torch.ops.radixserve_cpu.panel_linear_supported(self.weight.dtype))
            if not self.usable:
                self.packed = None
                return None
        return torch.ops.radixserve_cpu.panel_linear(x, self.packed, bias)
