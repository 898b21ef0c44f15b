"""bfloat16 linear layers on AMX tiles (kernels/cpu_amx_linear.cpp), for the CPU's packed linears (packed.py).

Two loops over a copy of the weight packed into the tiles' pair layout: `amx_linear` for decode batches, which reads
each weight tile once per 32 rows (a decode step costs the weights' reading), and `amx_gemm` for prefill steps,
which keeps a slice of 32 input rows in L1 while the weight's column panels stream past (a prefill step costs the
tile products). The row counts of each are the dispatch table's (dispatch.py).

`AmxWeight` packs at the first call in its rows that finds the kernel library loaded and the tiles granted by the
OS. The copy adds the weights' size once more: the caller makes one only under the memory rule of the other packed
copies (`extra_copy_fits`, small_batch.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import NO_ROWS, LinearRoute


def pack_for_tiles(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` as `[N / 16, K / 32, 16, 16, 2]`: element (nb, kb, r, n, e) = weight[16 nb + n, 32 kb + 2 r + e]
    (the B operand of TDPBF16PS: 16 rows of K pairs by 16 columns)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def shape_supported(weight: torch.Tensor) -> bool:
    """The kernel takes 32 output columns and 32 of K at a time."""
    return weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0


class AmxWeight:
    """A linear's weight for the AMX kernel: packed at the first call that finds the kernel usable; `linear`
    returns None (the caller's other path) outside the route's `amx` rows and below its `amx_prefill_from`, or where
    the kernel cannot run. `copy_fits`: whether the packed copy may be made at all."""

    def __init__(self, weight: torch.Tensor, route: LinearRoute, copy_fits: bool = True) -> None:
        self.weight = weight
        self.rows, self.prefill_from = route.amx, route.amx_prefill_from
        wanted = self.rows != NO_ROWS or self.prefill_from is not None
        self.usable: Optional[bool] = None if wanted and copy_fits and shape_supported(weight) else False
        self.packed: Optional[torch.Tensor] = None

    def refresh(self) -> None:
        """Pack the weight's new values again (after a weight update); an unpacked copy is packed at first use."""
        if self.packed is not None:
            self.packed = pack_for_tiles(self.weight)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.usable is False:
            return None
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        prefill = self.prefill_from is not None and rows >= self.prefill_from
        if not prefill and not self.rows[0] <= rows <= self.rows[1]:
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
