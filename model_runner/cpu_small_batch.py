"""float32 linear layers on the CPU that run inputs of a few rows through pre-packed oneDNN weights.

A speculative verify step feeds each request's chain (the last token and up to `num_draft_tokens - 1`
drafts) through the model: a handful of rows per linear layer. For such shapes torch's float32 `F.linear`
repacks the whole weight on every call, so a 6-row verify forward of SmolLM2-135M cost about twice a 1-row
decode forward (measured on a 2-core AVX-512 machine, one thread: 128 ms against 65 ms), which ate most of
what the accepted drafts saved. oneDNN's blocked layout, packed once at load time
(`torch.ops.mkldnn._reorder_linear_weight`, as model_runner/cpu_packed.py does for bfloat16), makes the cost
nearly flat in the number of rows (the LM head of that model: 10 ms for 6 rows against 19 ms).

`SmallBatchLinear` keeps `F.linear` outside `[MIN_PACKED_ROWS, MAX_PACKED_ROWS]`: up to three rows (plain decode at
batch size 1 and short verify chains, products torch already streams once) and prefill-sized inputs (where both paths
cost the same) stay exactly as they were. Inside the range the results are float32 products of the same
numbers, summed in another order (a relative difference of about 1e-6).

The packed copy doubles the weights' memory. The runner packs when speculative decoding is on (the verify
forward) and, for decode batches of a few to 64 requests, whenever the copy takes at most
`MAX_EXTRA_MEMORY_FRACTION` of the machine's memory (the embedded model: 0.5 GB; model_runner/model_runner.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens) for which the packed path measured faster than F.linear (2 cores, AVX-512, SmolLM2 shapes, one
# thread, every layer's weights in turn as in a forward: F.linear streams up to 3 rows at the cost of about one,
# 42 ms against the packed path's 47 ms for the 120 projections at 3 rows; from 4 rows the packed path wins).
MIN_PACKED_ROWS = 4
MAX_PACKED_ROWS = 64
# Without speculation, pack only when the packed copy takes at most this share of the machine's memory.
MAX_EXTRA_MEMORY_FRACTION = 0.1


def small_batch_packing_pays(model: nn.Module, speculative_algorithm: Optional[str]) -> bool:
    """Whether to pack `model`'s float32 CPU linears: always for speculative decoding, else when the copy is
    small next to the machine's memory."""
    if speculative_algorithm is not None:
        return True
    import psutil

    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                       if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
                       and m.weight.dtype == torch.float32)
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
    """`x @ W.T (+ b)` for float32 CPU tensors: oneDNN's pre-packed weight for a few rows, `F.linear` else."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the plain weight stays (state_dict readers, the other row counts)
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not MIN_PACKED_ROWS <= rows.shape[0] <= MAX_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def _single_rank(module: nn.Module) -> bool:
    tp = getattr(module, "tp", None)
    return tp is None or tp.size == 1


def pack_small_batch_linears(model: nn.Module) -> int:
    """Replace the float32 CPU projections of `model` (`nn.Linear`, and `RowParallelLinear` on one rank) by
    `SmallBatchLinear`, and give the LM head one (`model.logits_head`, read by `compute_logits`); returns how
    many linears were packed (0 when oneDNN cannot do it here)."""
    from radixserve.model_runner.parallel import RowParallelLinear

    if not small_batch_packing_supported():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (type(child) is nn.Linear or (type(child) is RowParallelLinear and _single_rank(child)))
        and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, SmallBatchLinear(child.weight, child.bias))
    if not hasattr(model, "logits_head") or not _single_rank(model):
        return len(targets)
    head = getattr(model, "lm_head", None)
    if isinstance(head, SmallBatchLinear):  # an untied head was packed above
        model.logits_head = head
    elif head is None and model.lm_head_weight.dtype == torch.float32 and model.lm_head_weight.device.type == "cpu":
        model.logits_head = SmallBatchLinear(model.lm_head_weight, None)  # tied to the embedding
        return len(targets) + 1
    return len(targets)
