"""float32 linear layers on the CPU for inputs of a few rows: the column-panel kernel, the small-row C++ kernel,
pre-packed oneDNN weights or `F.linear`, by the row counts of the dispatch table (dispatch.py).

Decode batches and speculative verify chains feed a handful of rows through each linear layer, where the cost is
reading the weight. torch's float32 `F.linear` streams up to 3 rows at little more than the cost of one and takes a
slower path from 4 rows on; oneDNN's blocked layout, packed once at load time
(`torch.ops.mkldnn._reorder_linear_weight`), is nearly flat in the rows; the C++ kernel (kernels/cpu_linear.cpp,
`torch.ops.radixserve_cpu.small_linear`) reads the plain weight once per call. The kernel and the packed path sum the
same float32 products in other orders than `F.linear` (a relative difference of about 1e-6).

The packed copy doubles the weights' memory. The runner makes it when speculative decoding is on (verify steps of
more than 16 rows) and otherwise whenever it takes at most `MAX_EXTRA_MEMORY_FRACTION` of the machine's memory (the
embedded model: 0.5 GB); the kernel needs no copy.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import CpuKernels, Rows, this_cpu
from radixserve.model_runner.cpu.panel_linear import PanelWeight

# Without speculation, pack only when the packed copy takes at most this share of the machine's memory.
MAX_EXTRA_MEMORY_FRACTION = 0.1


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  rows: Rows) -> Optional[torch.Tensor]:
    """`x @ weight.T (+ bias)` by the C++ kernel when x's row count is inside `rows` and the kernels are loaded;
    None otherwise (the caller's other path)."""
    count = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows[0] <= count <= rows[1] or not cpu_build.ready():
        return None
    return torch.ops.radixserve_cpu.small_linear(x, weight, bias)


def small_batch_packing_pays(model: nn.Module, speculative: bool) -> bool:
    """Whether to pack `model`'s float32 CPU linears: always for speculative decoding, else when the copy is
    small next to the machine's memory."""
    return speculative or extra_copy_fits(model, torch.float32)


def extra_copy_fits(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether one more copy of `model`'s matrix weights of `dtype` on the CPU (each shared weight counted once)
    takes at most `MAX_EXTRA_MEMORY_FRACTION` of the machine's memory."""
    import psutil

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if p.dim() == 2 and p.dtype == dtype and p.device.type == "cpu")
    return weight_bytes <= MAX_EXTRA_MEMORY_FRACTION * psutil.virtual_memory().total


def small_batch_packing_supported() -> bool:
    """Whether this torch can pack and run float32 linear weights through oneDNN."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(3, 8), probe, None, "none", [], "")
        return True
    except (AttributeError, RuntimeError):
        return False


class SmallBatchLinear(nn.Module):
    """`x @ W.T (+ b)` for float32 CPU tensors: the panel kernel, the small-row kernel, oneDNN's pre-packed weight or
    `F.linear`, by the number of rows (`kernels`' route; this CPU's default table when None). `packed=False`: no
    packed copy (the small-row kernel still runs); `panel=False`: no panel copy."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, packed: bool = True,
                 head: bool = False, panel: bool = True, kernels: Optional[CpuKernels] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the plain weight stays (state_dict readers, the kernel, the other row counts)
        self.bias = bias
        route = (kernels or this_cpu()).linear(weight.dtype, head=head)
        self.kernel_rows = route.small
        self.packed_from = route.packed_from
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if packed else None
        self.panel = PanelWeight(weight, route, copy_fits=panel)

    def refresh(self) -> None:
        """Make the packed copies again from the plain weight's new values (after a weight update)."""
        if self._packed is not None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.panel.refresh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.panel.linear(x, self.bias)
        if out is not None:
            return out
        out = kernel_linear(x, self.weight, self.bias, self.kernel_rows)
        if out is not None:
            return out
        rows = x.reshape(-1, self.in_features)
        if self._packed is None or rows.shape[0] < self.packed_from:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def _single_rank(module: nn.Module) -> bool:
    tp = getattr(module, "tp", None)
    return tp is None or tp.size == 1


def pack_small_batch_linears(model: nn.Module, kernels: CpuKernels, packed: bool = True,
                             lm_head: bool = True) -> int:
    """Replace the float32 CPU projections of `model` (`nn.Linear`, and `RowParallelLinear` on one rank) by
    `SmallBatchLinear` routed by `kernels`, and give the LM head one (`model.logits_head`, read by `compute_logits`);
    with `packed` (and where oneDNN can pack here) each keeps a packed copy of its weight. `lm_head` False (a model
    that only pools, whose LM head never runs): the head is left as it is. Starts loading the CPU kernels in the
    background. Returns how many linears were replaced."""
    from radixserve.model_runner.parallel import RowParallelLinear

    panel = packed  # the panel kernel's copy follows the same memory rule
    packed = packed and small_batch_packing_supported()
    cpu_build.start_background_build()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (type(child) is nn.Linear or (type(child) is RowParallelLinear and _single_rank(child)))
        and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
        and (lm_head or child is not getattr(model, "lm_head", None))
    ]
    head = getattr(model, "lm_head", None)
    for parent, name, child in targets:
        setattr(parent, name, SmallBatchLinear(child.weight, child.bias, packed=packed, head=child is head,
                                               panel=panel, kernels=kernels))
    installed = getattr(model, "logits_head", None)
    if lm_head and getattr(installed, "wants_dense", False) and installed.dense is None:
        # the GGUF blocks' head, which keeps the float path's head for many rows (model_runner/cpu/gguf_linear.py)
        installed.dense = SmallBatchLinear(model.lm_head_weight, None, packed=packed, head=True, panel=panel,
                                           kernels=kernels)
        return len(targets) + 1
    if not lm_head or not hasattr(model, "logits_head") or not _single_rank(model) or installed is not None:
        return len(targets)  # (a head already installed: the GGUF blocks' own, model_runner/cpu/gguf_linear.py)
    head = getattr(model, "lm_head", None)  # the replacement, where an untied head was replaced above
    if isinstance(head, SmallBatchLinear):  # an untied head was replaced above
        model.logits_head = head
    elif head is None and model.lm_head_weight.dtype == torch.float32 and model.lm_head_weight.device.type == "cpu":
        model.logits_head = SmallBatchLinear(model.lm_head_weight, None, packed=packed, head=True,  # tied
                                             panel=panel, kernels=kernels)
        return len(targets) + 1
    return len(targets)
