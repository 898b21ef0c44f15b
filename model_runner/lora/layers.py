"""Batched LoRA: one forward pass serves requests of different adapters and of the base model.

`LoRALinear` wraps a projection of the base model (q/k/v fused as `qkv_proj`, gate/up as `gate_up_proj`,
`o_proj`, `down_proj`) and adds, for each token, the low-rank delta of its request's adapter:

    y = W x + B[slot(t)] (A[slot(t)] x)        (the adapter's scale is folded into B when it is loaded)

The adapters live in a fixed pool of `max_loras_per_batch` slots (`LoRAWeightPool`), each padded to
`max_lora_rank` with zeros, so a batch indexes them by slot. `segmented_lora` is the segmented gather matmul of
S-LoRA/Punica written with torch ops: tokens are grouped by slot (one group per adapter in the batch, base-model
tokens skipped), and each group runs two small matmuls. It is the path on the CPU and the reference for a fused
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class LoRABatch:
    """Which tokens of the current forward pass use which pool slot: `groups[i] = (slot, token_indices)`;
    `token_indices` is None when the group is every token of the batch (no gather needed)."""

    groups: list[tuple[int, Optional[torch.Tensor]]]
    num_tokens: int
    token_slots: Optional[torch.Tensor] = None  # [T] int64 slot of each token (-1: base), for the fused kernel


class LoRAWeightPool:
    """Per layer and adapted module, `A [slots, max_rank, in]` and `B [slots, out, max_rank]` on the device."""

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for module, (in_features, out_features) in shapes.items():
            self.a[module] = torch.zeros(num_layers, num_slots, max_rank, in_features, dtype=dtype, device=device)
            self.b[module] = torch.zeros(num_layers, num_slots, out_features, max_rank, dtype=dtype, device=device)

    def write(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's (A, scaled B) pairs into `slot`; modules it does not adapt are zeroed there."""
        for module in self.a:
            self.a[module][:, slot].zero_()
            self.b[module][:, slot].zero_()
        for (layer, module), (a, b) in weights.items():
            rank = a.shape[0]
            self.a[module][layer, slot, :rank].copy_(a)
            self.b[module][layer, slot, :, :rank].copy_(b)


def segmented_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> Optional[torch.Tensor]:
    """`delta[t] = b[slot(t)] @ (a[slot(t)] @ x[t])` for the tokens of `batch.groups`, zeros elsewhere.

    x `[T, in]`, a `[slots, r, in]`, b `[slots, out, r]`; returns `[T, out]`, or None when no token has an adapter.
    """
    if not batch.groups:
        return None
    out: Optional[torch.Tensor] = None
    for slot, index in batch.groups:
        rows = x if index is None else x.index_select(0, index)
        delta = (rows @ a[slot].transpose(0, 1)) @ b[slot].transpose(0, 1)
        if index is None:
            return delta
        if out is None:
            out = x.new_zeros(x.shape[0], b.shape[1])
        out.index_copy_(0, index, delta)
    return out


def lora_delta_for(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> Optional[torch.Tensor]:
    """The batch's delta through the Triton kernel on CUDA, the torch path elsewhere."""
    if x.is_cuda and batch.groups and batch.token_slots is not None:
        from radixserve.kernels.lora_sgmv import lora_delta

        return lora_delta(x, a, b, batch.token_slots)
    return segmented_lora(x, a, b, batch)


class LoRALinear(nn.Module):
    """A base projection plus the batch's LoRA deltas for the modules fused into it.

    `parts` are (module name, first output column, end column) of each adapted module inside the fused output,
    e.g. q, k and v inside `qkv_proj`. `context.batch` is the current forward pass's LoRABatch (None: base only).
    """

    def __init__(self, base: nn.Module, layer_id: int, parts: list[tuple[str, int, int]], pool: LoRAWeightPool,
                 context: "LoRAContext") -> None:
        super().__init__()
        self.base = base
        self.layer_id = layer_id
        self.parts = parts
        self.pool = pool
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.context.batch
        if batch is None:
            return y
        for module, start, end in self.parts:
            delta = lora_delta_for(x, self.pool.a[module][self.layer_id], self.pool.b[module][self.layer_id], batch)
            if delta is not None:
                y[:, start:end] += delta.to(y.dtype)
        return y


class LoRAContext:
    """The LoRABatch of the forward pass being run (set by the manager before each forward)."""

    batch: Optional[LoRABatch] = None
