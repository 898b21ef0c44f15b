"""float32 linear layers on the CPU for inputs of a few rows: the small-row C++ kernel, pre-packed oneDNN weights
or `F.linear`, whichever measured fastest for the row count.

Decode batches and speculative verify chains feed a handful of rows through each linear layer, where the cost is
reading the weight. torch's float32 `F.linear` streams up to 3 rows at little more than the cost of one and takes a
slower path from 4 rows on (a 6-row verify forward of SmolLM2-135M cost about twice a decode forward); oneDNN's
blocked layout, packed once at load time (`torch.ops.mkldnn._reorder_linear_weight`), is nearly flat in the rows but
costs more than `F.linear` at 1 to 3; the C++ kernel (kernels/cpu_linear.cpp, `torch.ops.radixserve_cpu.small_linear`)
reads the plain weight once per call and is the fastest of the three from 2 to 16 rows (benchmarks/cpu_linear.py;
figures in docs/benchmarks.md).

`SmallBatchLinear` routes by row count: on AVX-512 the column-panel kernel for decode batches (its `ROWS`,
model_runner/cpu_panel_linear.py), ahead of the rest; the kernel inside `KERNEL_ROWS` once the CPU kernels are
loaded, the packed weight from `MIN_PACKED_ROWS` rows on (prefill chunks included) where the runner made a packed
copy, `F.linear` otherwise (one-row decode of the projections but on AMD CPUs, or no packed copy). The kernel and the
packed path sum the same float32 products in other orders than `F.linear` (a relative difference of about 1e-6).

The packed copy doubles the weights' memory. The runner makes it when speculative decoding is on (verify steps of
more than 16 rows) and otherwise whenever it takes at most `MAX_EXTRA_MEMORY_FRACTION` of the machine's memory (the
embedded model: 0.5 GB; model_runner/model_runner.py); the kernel needs no copy.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu_panel_linear import PanelWeight

# Rows (tokens) for which the packed path measured faster than F.linear (2 cores, AVX-512, SmolLM2 shapes, one
# thread, every layer's weights in turn as in a forward: F.linear streams up to 3 rows at the cost of about one,
# 42 ms against the packed path's 47 ms for the 120 projections at 3 rows; from 4 rows the packed path wins).
# Prefill rows too: on a 2-core AVX-512-BF16 machine (AMD EPYC) the packed weight beat `F.linear` at every count
# measured from 65 to 2,048 rows, the 120 projections of a SmolLM2 forward 865 against 678 ms at 512 rows
# (benchmarks/cpu_linear.py; docs/benchmarks.md).
MIN_PACKED_ROWS = 4
# Without speculation, pack only when the packed copy takes at most this share of the machine's memory.
MAX_EXTRA_MEMORY_FRACTION = 0.1
# Rows (inclusive) for which kernels/cpu_linear.cpp measured fastest, per weight dtype: (projections, LM head).
# benchmarks/cpu_linear.py, 2-core AVX-512 machine (Intel, AMX), one and two threads: float32 projections 2-16 rows
# (one row: F.linear 34.4 ms, the kernel 36.4 ms for the 120 of a forward), the float32 LM head from one row (6.3 ms
# against 7.7); bfloat16 projections up to 4 rows (the packed weights, on AMX, from 5: 25.7 against 27.3 ms at 5
# rows) and the bfloat16 LM head at one row (from 2 rows the packed head is faster). Where the CPU has AMX tiles the
# bfloat16 linears run the AMX kernel from 2 rows instead (model_runner/cpu_amx_linear.py).
KERNEL_ROWS: dict[torch.dtype, tuple[tuple[int, int], tuple[int, int]]] = {
    torch.float32: ((2, 16), (1, 16)),
    torch.bfloat16: ((1, 4), (1, 1)),
}
NO_ROWS = (1, 0)
# One-row float32 projections: `F.linear` (torch's BLAS, MKL on x86) streams one row about as fast as the kernel on
# Intel CPUs (the figures above) and slowly on AMD's: on a 2-core AMD EPYC (Zen 4) it took 35.6 ms for the 120
# projections at 2 threads and 35.7 at one, against the kernel's 15.2 and 20.8 (with AVX2 only, emulated there:
# 40.9 and 40.0 against 18.4 and 25.5). On CPUs of these vendors the kernel takes one row too.
ONE_ROW_KERNEL_VENDORS = ("AuthenticAMD",)


def kernel_rows(dtype: torch.dtype, head: bool) -> tuple[int, int]:
    """Row range (inclusive; empty as `(1, 0)`) in which a linear of this weight dtype runs the C++ kernel;
    `RADIXSERVE_CPU_SMALL_LINEAR=0` keeps every linear off it (the packed path and `F.linear` as before it)."""
    if os.environ.get("RADIXSERVE_CPU_SMALL_LINEAR", "1") == "0":
        return NO_ROWS
    ranges = KERNEL_ROWS.get(dtype)
    if ranges is None:
        return NO_ROWS
    low, high = ranges[1 if head else 0]
    if dtype == torch.float32 and cpu_build.cpu_vendor() in ONE_ROW_KERNEL_VENDORS:
        low = 1
    return low, high


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  rows: tuple[int, int]) -> Optional[torch.Tensor]:
    """`x @ weight.T (+ bias)` by the C++ kernel when x's row count is inside `rows` and the kernels are loaded;
    None otherwise (the caller's other path)."""
    count = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows[0] <= count <= rows[1] or not cpu_build.ready():
        return None
    return torch.ops.radixserve_cpu.small_linear(x, weight, bias)


def small_batch_packing_pays(model: nn.Module, speculative_algorithm: Optional[str]) -> bool:
    """Whether to pack `model`'s float32 CPU linears: always for speculative decoding, else when the copy is
    small next to the machine's memory."""
    return speculative_algorithm is not None or extra_copy_fits(model, torch.float32)


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
    """`x @ W.T (+ b)` for float32 CPU tensors: the C++ kernel, oneDNN's pre-packed weight or `F.linear`, by the
    number of rows (see the module's docstring). `packed=False`: no packed copy (the kernel still runs)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, packed: bool = True,
                 head: bool = False, panel: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the plain weight stays (state_dict readers, the kernel, the other row counts)
        self.bias = bias
        self.kernel_rows = kernel_rows(weight.dtype, head)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if packed else None
        self.panel = PanelWeight(weight, head=head, enabled_here=panel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.panel.linear(x, self.bias)
        if out is not None:
            return out
        out = kernel_linear(x, self.weight, self.bias, self.kernel_rows)
        if out is not None:
            return out
        rows = x.reshape(-1, self.in_features)
        if self._packed is None or rows.shape[0] < MIN_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def _single_rank(module: nn.Module) -> bool:
    tp = getattr(module, "tp", None)
    return tp is None or tp.size == 1


def pack_small_batch_linears(model: nn.Module, packed: bool = True) -> int:
    """Replace the float32 CPU projections of `model` (`nn.Linear`, and `RowParallelLinear` on one rank) by
    `SmallBatchLinear`, and give the LM head one (`model.logits_head`, read by `compute_logits`); with `packed`
    (and where oneDNN can pack here) each keeps a packed copy of its weight. Starts loading the CPU kernels in the
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
    ]
    head = getattr(model, "lm_head", None)
    for parent, name, child in targets:
        setattr(parent, name, SmallBatchLinear(child.weight, child.bias, packed=packed, head=child is head,
                                               panel=panel))
    if not hasattr(model, "logits_head") or not _single_rank(model):
        return len(targets)
    head = getattr(model, "lm_head", None)  # the replacement, where an untied head was replaced above
    if isinstance(head, SmallBatchLinear):  # an untied head was replaced above
        model.logits_head = head
    elif head is None and model.lm_head_weight.dtype == torch.float32 and model.lm_head_weight.device.type == "cpu":
        model.logits_head = SmallBatchLinear(model.lm_head_weight, None, packed=packed, head=True,  # tied
                                             panel=panel)
        return len(targets) + 1
    return len(targets)
