"""The quantized linear layer: a `QuantizedWeight` (FP8 or 4-bit, model_runner/quantization/) multiplied by the
method the model was loaded with, as a column-parallel layer (fused q/k/v and gate/up, or a projection that needs no
reduction) or a row-parallel one (o and down projections, all-reduced over the tensor-parallel ranks).

It replaces an `nn.Linear` or `RowParallelLinear` of the model, built on the meta device, before the weights load
(`swap_quantized_linears`); its weight arrives whole from the loader (`set_weight`), already this rank's shard and
fused. A bias stays a float parameter, loaded by the model's own loader like any other.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.model_runner.parallel import RowParallelLinear, TPGroup
from radixserve.model_runner.quantization.fp8 import Fp8Weight
from radixserve.model_runner.quantization.methods import LinearMethod, QuantizedWeight

# The model's projections that quantized checkpoints quantize (the LM head, embeddings, norms and MoE routers stay).
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod,
                 row_parallel_tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method
        self.row_parallel_tp = row_parallel_tp if row_parallel_tp is not None and row_parallel_tp.size > 1 else None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_value: Optional[QuantizedWeight] = None
        self.tensor_scale: Optional[torch.Tensor] = None  # an FP8 weight's one scale when all rows share it

    def set_weight(self, weight: QuantizedWeight) -> None:
        """Install this rank's whole weight; its tensors become buffers (they move and count with the model)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {weight.shape} for a {self.out_features}x{self.in_features} "
                             "linear")
        if isinstance(weight, Fp8Weight):
            if weight.block is None and bool((weight.scale == weight.scale[0]).all()):
                self.tensor_scale = weight.scale[0].clone()
        else:
            weight = weight.finalized()
        self.weight_value = weight
        for name, value in vars(weight).items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"q_{name}", value, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight_value is not None, "quantized linear used before its weight was loaded"
        shape = x.shape
        out = self.method.apply(self.weight_value, x.reshape(-1, shape[-1]), self.tensor_scale)
        out = out.reshape(*shape[:-1], self.out_features)
        if self.row_parallel_tp is not None:
            out = self.row_parallel_tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.describe()}")


def swap_quantized_linears(model: nn.Module, method: LinearMethod, hf_parts: dict[str, list[str]]) -> list[str]:
    """Replace the model's projections (QUANTIZED_PROJECTIONS) whose checkpoint linears the method quantizes by
    QuantizedLinear layers (on whatever device the model is, the meta device before the weights load); returns
    their names. `hf_parts` maps a module name to the checkpoint linears stacked into it (see loader.py)."""
    swapped = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in QUANTIZED_PROJECTIONS or not isinstance(module, (nn.Linear, RowParallelLinear)):
            continue
        quantized = [method.quantizes(part) for part in hf_parts[name]]
        if not any(quantized):
            continue
        if not all(quantized):
            raise ValueError(f"{method.name}: the checkpoint quantizes only some of {', '.join(hf_parts[name])}, "
                             f"which radixserve runs as one fused {leaf}")
        out_features, in_features = module.weight.shape
        tp = module.tp if isinstance(module, RowParallelLinear) else None
        replacement = QuantizedLinear(in_features, out_features, module.bias is not None, method, tp)
        replacement.to(module.weight.device, module.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        swapped.append(name)
    return swapped
