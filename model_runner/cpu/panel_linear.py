"""Linear layers of decode batches on AVX-512 CPUs: the column-panel kernel (kernels/cpu_panel_linear.cpp) on a copy
of the weight packed for it, float32 and bfloat16.

A decode step feeds a few dozen rows through each projection, and every layer's weights stream from memory once a
step. oneDNN's packed inner product spends about a tenth of its time there waiting for the weights; the panel
kernel prefetches the next column panel while it multiplies the current one. Its rows, and the CPUs it runs on,
are the dispatch table's (dispatch.py).

`PanelWeight` packs when it is made, where its route has rows (so neither the first request nor a timed run pays for
it), and answers None (the caller's other path) outside those rows, until the kernel library has loaded (in the
background), or where the shape does not fit (32 output columns a panel; an even K in bfloat16). The copy adds the
weights' size once more: the callers make one only under the memory rule of the other packed copies
(`extra_copy_fits`, small_batch.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import NO_ROWS, LinearRoute

PANEL = 32
DTYPES = (torch.float32, torch.bfloat16)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` as the kernel's panels: float32 `[N / 32, K, 32]`, element (p, k, c) = weight[32 p + c, k];
    bfloat16 `[N / 32, K / 2, 32, 2]`, element (p, j, c, e) = weight[32 p + c, 2 j + e]."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        return w.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return w.view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def shape_supported(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype in DTYPES and weight.shape[0] % PANEL == 0
            and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))


class PanelWeight:
    """A linear's weight for the panel kernel, for the route's `panel` rows. `copy_fits`: whether the panel copy may
    be made at all."""

    def __init__(self, weight: torch.Tensor, route: LinearRoute, copy_fits: bool = True) -> None:
        self.weight = weight
        usable = copy_fits and route.panel != NO_ROWS and shape_supported(weight) and weight.device.type == "cpu"
        self.usable: Optional[bool] = None if usable else False  # None: until the library says
        self.rows = route.panel if usable else NO_ROWS
        self.packed = pack_panels(weight) if usable else None

    def refresh(self) -> None:
        """Pack the weight's new values again (after a weight update)."""
        if self.packed is not None:
            self.packed = pack_panels(self.weight)

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
