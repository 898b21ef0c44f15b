"""Linear layers on a GPU that run inputs of a few rows through the skinny Triton GEMM.

A decode step of a small batch is a pass over every weight of the model with a handful of activation rows;
cuBLAS runs those products as split-K GEMVs plus a reduction kernel each (kernels/skinny_gemm.py says why one
kernel that reads the weight once does better). `SkinnyLinear` sends inputs of at most `max_rows` rows there
and everything larger (prefill, large decode batches) to `F.linear`, exactly as before.

The runner swaps the model's projections for these (`use_skinny_linears`) on CUDA in float16 and bfloat16
when `--skinny-gemm-max-rows` is above 0, on one tensor-parallel rank only (a row-parallel layer's all-reduce
stays with `RowParallelLinear`). The results are the same float32 sums of the same products as cuBLAS's,
in another order: a difference of at most a rounding step of the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.skinny_gemm import MAX_ROWS


class SkinnyLinear(nn.Module):
    """`x @ W.T (+ b)`: the skinny kernel for at most `max_rows` rows, `F.linear` else."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rows: int) -> None:
        super().__init__()
        assert 1 <= max_rows <= MAX_ROWS, f"max_rows must be in [1, {MAX_ROWS}], got {max_rows}"
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        from radixserve.kernels.skinny_gemm import skinny_gemm

        out = skinny_gemm(x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, max_rows={self.max_rows}"


def use_skinny_linears(model: nn.Module, max_rows: int) -> int:
    """Replace the projections of `model` (`nn.Linear`, and `RowParallelLinear` on one rank) and its LM head by
    `SkinnyLinear`s of `max_rows`; returns how many were replaced."""
    from radixserve.model_runner.parallel import RowParallelLinear

    if getattr(model, "tp", None) is not None and model.tp.size > 1:
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, RowParallelLinear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, SkinnyLinear(child.weight, child.bias, max_rows))
    if hasattr(model, "logits_head") and model.logits_head is None:
        head = getattr(model, "lm_head", None)
        model.logits_head = head if isinstance(head, SkinnyLinear) else SkinnyLinear(
            model.lm_head_weight, None, max_rows)
        return len(targets) + 1
    return len(targets)
