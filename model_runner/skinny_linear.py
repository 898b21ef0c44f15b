"""16-bit linears at decode row counts on the skinny GEMM (kernels/fp8_skinny_gemm.py), where cuBLAS streams them
slowly.

A decode step's product of one row by a 16-bit weight is the weight's bytes over the memory bandwidth. cuBLAS picks
its tiles by heuristics that, for some of these shapes, leave most SMs without loads in flight: Qwen3-30B-A3B's
router (128 x 2048, half a megabyte) runs on two CTAs in about 5 us on an H100, and its o projection (2048 x 4096)
as a split-K GEMM plus a separate reduction kernel. The skinny kernel splits K over enough programs to fill the GPU
and adds the splits in the same launch. `TUNED_16BIT` lists the shapes (and row counts) where it measured faster than
cuBLAS, with the config; `use_skinny_linears` gives exactly those layers a `SkinnyLinear`, which multiplies up to the
measured row count on the skinny kernel and above it with `F.linear`. Other shapes keep cuBLAS.

Only on CUDA with 16-bit weights, and not with `--enable-deterministic-inference` (whose linears are the batch-
invariant ones). A `SkinnyLinear` holds the replaced layer's own tensors, so weight updates reach it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.kernels.guard import KernelGuard
from radixserve.model_runner.parallel import RowParallelLinear, TPGroup, plain_linears

# kernels/fp8_skinny_gemm.py's 16-bit path, turned off (the reason logged) once it fails to compile for this device.
_skinny = KernelGuard("the skinny 16-bit GEMM", "cuBLAS serves every 16-bit linear")


class SkinnyLinear(nn.Module):
    """`x @ weight.T (+ bias)`: up to `max_rows` rows on the skinny kernel, more on `F.linear`; all-reduced over `tp`
    when it replaced a row-parallel layer of several ranks."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rows: int,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.max_rows = max_rows
        self.tp = tp if tp is not None and tp.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.numel() // self.in_features
        out = None
        if rows <= self.max_rows and x.is_cuda and _skinny.usable:
            from radixserve.kernels.fp8_skinny_gemm import w16a16_gemm  # CPU-only processes never import triton

            try:
                out = w16a16_gemm(x.reshape(rows, self.in_features), self.weight).reshape(*shape[:-1],
                                                                                          self.out_features)
            except Exception as exc:  # a compile failure on this device: logged once, cuBLAS from then on
                if not _skinny.absorb(exc):
                    raise
        if out is None:
            out = torch.nn.functional.linear(x, self.weight)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, max_rows={self.max_rows}"


def skinny_rows(out_features: int, in_features: int) -> int:
    """Up to how many rows a 16-bit `out_features x in_features` product measured faster on the skinny kernel
    (`TUNED_16BIT`); 0 for a shape it does not list."""
    from radixserve.kernels.fp8_skinny_gemm import TUNED_16BIT

    rows = TUNED_16BIT.get((out_features, in_features))
    return rows[-1][0] if rows else 0


def use_skinny_linears(model: nn.Module) -> list[str]:
    """Replace `model`'s 16-bit `nn.Linear` and `RowParallelLinear` layers whose shape `TUNED_16BIT` lists by
    `SkinnyLinear`; returns their names."""
    replaced = []
    for parent_name, parent, name, child in plain_linears(model):
        max_rows = skinny_rows(*child.weight.shape) if child.weight.dtype in (torch.bfloat16, torch.float16) else 0
        if max_rows:
            tp = child.tp if isinstance(child, RowParallelLinear) else None
            setattr(parent, name, SkinnyLinear(child.weight, child.bias, max_rows, tp))
            replaced.append(f"{parent_name}.{name}" if parent_name else name)
    return replaced
