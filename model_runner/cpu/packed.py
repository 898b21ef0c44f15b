"""bfloat16 linear layers on the CPU with their weights packed once into oneDNN's blocked layout.

`F.linear` on bfloat16 CPU tensors goes through oneDNN, which reorders the weight into its blocked layout on
every call; for the small batches of decode that reorder is a large part of the cost. `PackedLinear` does it
once, at load time (`torch.ops.mkldnn._reorder_linear_weight`), and multiplies with
`torch.ops.mkldnn._linear_pointwise`. Same kernels, same rounding: the outputs equal `F.linear`'s bit for bit
(`tests/test_model_forward.py`).
Measured on a 2-core AVX-512-BF16 machine, the four projections of a SmolLM2-135M layer: 36% less time at 8
tokens, 14% at 64, 10% at 512; on a 2-core AMX machine, the 49k-row LM head at 64 tokens 4.8 -> 2.4 ms.

Packed: every `nn.Linear`, the row-parallel projections of a single rank (plain linears there), and the LM head;
a tied LM head (the embedding's weight) gets a packed copy of its own, `model.logits_head`.

At the fewest rows (up to 4 for the projections, one for the LM head: `KERNEL_ROWS` in model_runner/cpu_small_batch.py)
the small-row C++ kernel (kernels/cpu_linear.cpp) runs instead once the CPU kernels are loaded: it reads the plain
bfloat16 weight once, widening it to float32 in registers, and measured faster than the packed path there (the 120
projections of a forward at one row and one thread: 23.6 against 25.5 ms; two threads 11.6 against 14.6). Its outputs
are the float32 sums rounded once to bfloat16, as oneDNN's, summed in another order (not bit-equal to `F.linear`).

From 2 to 128 rows (decode batches) and from 256 rows (prefill) the AMX kernel's two loops run on a tile-packed
copy of the weight where the CPU has AMX-BF16 (model_runner/cpu_amx_linear.py), ahead of the small-row kernel.
Without AMX but with AVX512_BF16, decode batches (2 to 128 rows, the LM head to 64) run the column-panel kernel on
a copy of its own (model_runner/cpu_panel_linear.py). Elsewhere, and at the other row counts, as described.

On a CPU with AMX-BF16 but without the AMX kernel (its extra copy did not fit), at prefill row counts
(`PLAIN_MIN_ROWS` and more) the projections that do not widen their input (out_features <= in_features: o and down)
go back to `F.linear`, whose oneDNN matmul reads the plain weight and measured faster there than the packed inner
product (2-core AMX machine, 30 layers' weights in turn, 512 rows: o 313 -> 276 us, down 848 -> 603 us; 384 rows:
332 -> 269, 904 -> 611; the widening qkv and gate_up stay faster packed at every count). Without AMX the packed
weight is the faster one at those counts too (2-core AVX-512-BF16 machine, the 30 layers' o and down at 512 rows:
33.8 -> 30.6 and 75.5 -> 75.2 ms; at 2,048 rows: 118.5 -> 112.5 and 292.1 -> 278.8 ms; benchmarks/cpu_linear.py
`--by-projection`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu_amx_linear import AmxWeight
from radixserve.model_runner.cpu_panel_linear import PanelWeight
from radixserve.model_runner.cpu_small_batch import extra_copy_fits, kernel_linear, kernel_rows
from radixserve.model_runner.parallel import RowParallelLinear

# Rows from which a projection with out_features <= in_features runs `F.linear` instead of the packed weight.
PLAIN_MIN_ROWS = 384


def packing_supported() -> bool:
    """Whether this torch can pack and run bfloat16 linear weights through oneDNN on this CPU."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """`nn.Linear` with a pre-packed bfloat16 weight. The plain weight stays, for `state_dict` and readers."""

    def __init__(self, linear: nn.Module, head: bool = False, amx: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel_rows = kernel_rows(linear.weight.dtype, head)
        narrowing = self.out_features <= self.in_features
        has_amx = cpu_build.has_cpu_flag("amx_bf16")
        self.plain_min_rows = PLAIN_MIN_ROWS if narrowing and has_amx else None
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.amx = AmxWeight(linear.weight, enabled=amx)
        # Where the CPU has AMX tiles their kernel takes the panel kernel's rows: no copy for it there.
        self.panel = PanelWeight(linear.weight, head=head, enabled_here=amx and not has_amx)

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


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every packable bfloat16 linear of `model` that lives on the CPU by a `PackedLinear`, and pack a
    tied LM head; returns how many weights were packed (0 when packing is not supported here)."""
    if not packing_supported():
        return 0
    cpu_build.start_background_build()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child)
    ]
    lm_head = getattr(model, "lm_head", None)
    amx = extra_copy_fits(model, torch.bfloat16)
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, head=child is lm_head, amx=amx))
    single_rank = getattr(getattr(model, "tp", None), "size", 0) == 1
    if single_rank and isinstance(getattr(model, "lm_head", None), PackedLinear):  # an untied head, packed above
        model.logits_head = model.lm_head
    tied = getattr(model, "lm_head", False) is None and single_rank
    weight = model.lm_head_weight if tied else None
    if weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        head = nn.Linear(1, 1, bias=False)
        head.weight = weight
        model.logits_head = PackedLinear(head, head=True, amx=amx)
        return len(targets) + 1
    return len(targets)
