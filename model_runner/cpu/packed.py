"""bfloat16 linear layers on the CPU with their weights packed once into oneDNN's blocked layout.

`F.linear` on bfloat16 CPU tensors goes through oneDNN, which reorders the weight into its blocked layout on
every call; for the small batches of decode that reorder is a large part of the cost. `PackedLinear` does it
once, at load time (`torch.ops.mkldnn._reorder_linear_weight`), and multiplies with
`torch.ops.mkldnn._linear_pointwise`. Same kernels, same rounding: the outputs equal `F.linear`'s bit for bit
(`tests/model_runner/test_model_forward.py`).

Packed: every `nn.Linear`, the row-parallel projections of a single rank (plain linears there), and the LM head;
a tied LM head (the embedding's weight) gets a packed copy of its own, `model.logits_head`.

Ahead of the packed weight, by the dispatch table's rows (dispatch.py): the AMX kernel's two loops on a tile-packed
copy (amx_linear.py), the column-panel kernel on a copy of its own (panel_linear.py), the small-row kernel on the
plain weight (kernels/cpu_linear.cpp: float32 sums rounded once to bfloat16, as oneDNN's, in another order), and, for
the projections that do not widen their input on AMX CPUs, `F.linear` at prefill row counts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.amx_linear import AmxWeight
from radixserve.model_runner.cpu.dispatch import CpuKernels, this_cpu
from radixserve.model_runner.cpu.panel_linear import PanelWeight
from radixserve.model_runner.cpu.small_batch import extra_copy_fits, kernel_linear
from radixserve.model_runner.parallel import RowParallelLinear


def packing_supported() -> bool:
    """Whether this torch can pack and run bfloat16 linear weights through oneDNN on this CPU."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """`nn.Linear` with a pre-packed bfloat16 weight, routed by `kernels` (this CPU's default table when None).
    `copies`: whether the AMX and panel copies of the weight may be made. The plain weight stays, for `state_dict`
    and readers."""

    def __init__(self, linear: nn.Module, head: bool = False, copies: bool = True,
                 kernels: Optional[CpuKernels] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight = linear.weight
        self.bias = linear.bias
        route = (kernels or this_cpu()).linear(linear.weight.dtype, head=head,
                                               narrow=self.out_features <= self.in_features)
        self.kernel_rows = route.small
        self.plain_min_rows = route.plain_from
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.amx = AmxWeight(linear.weight, route, copy_fits=copies)
        self.panel = PanelWeight(linear.weight, route, copy_fits=copies)

    def refresh(self) -> None:
        """Make the packed copies again from the plain weight's new values (after a weight update)."""
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.amx.refresh()
        self.panel.refresh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., in_features]` bfloat16 on the CPU, like the weight."""
        out = self.amx.linear(x, self.bias)
        if out is not None:
            return out
        out = self.panel.linear(x, self.bias)
        if out is not None:
            return out
        out = kernel_linear(x, self.weight, self.bias, self.kernel_rows)
        if out is not None:
            return out
        rows = x.reshape(-1, self.in_features)
        if self.plain_min_rows is not None and rows.shape[0] >= self.plain_min_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def _packable(module: nn.Module) -> bool:
    plain = type(module) is nn.Linear or (type(module) is RowParallelLinear and module.tp.size == 1)
    return plain and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"


def pack_cpu_linears(model: nn.Module, kernels: CpuKernels, lm_head: bool = True) -> int:
    """Replace every packable bfloat16 linear of `model` that lives on the CPU by a `PackedLinear` routed by
    `kernels`, and pack a tied LM head; returns how many weights were packed (0 when packing is not supported
    here). `lm_head` False (a model that only pools, whose LM head never runs): the head is left as it is."""
    if not packing_supported():
        return 0
    cpu_build.start_background_build()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child) and (lm_head or child is not getattr(model, "lm_head", None))
    ]
    head_module = getattr(model, "lm_head", None)
    copies = extra_copy_fits(model, torch.bfloat16)
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, head=child is head_module, copies=copies, kernels=kernels))
    install_head = lm_head and getattr(getattr(model, "tp", None), "size", 0) == 1  # logits_head serves one rank
    if install_head and isinstance(getattr(model, "lm_head", None), PackedLinear):  # an untied head, packed above
        model.logits_head = model.lm_head
    tied = getattr(model, "lm_head", False) is None and install_head
    weight = model.lm_head_weight if tied else None
    if weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        head = nn.Linear(1, 1, bias=False)
        head.weight = weight
        model.logits_head = PackedLinear(head, head=True, copies=copies, kernels=kernels)
        return len(targets) + 1
    return len(targets)
