"""Loading a quantized checkpoint into a model whose projections were swapped for QuantizedLinear layers.

The checkpoint names its tensors per Hugging Face linear (`...self_attn.q_proj.weight_scale`); the model stacks q/k/v
and gate/up into one projection and holds one tensor-parallel shard of each. `QuantizedWeightLoader` routes every
tensor of a quantized linear to that linear's collection, and everything else (embeddings, norms, biases, the LM head)
to the model's own `load_weights`. When a linear's tensors are all in, the method turns them into the runtime layout,
this rank's shard is cut in the layout's own coordinates (output features for column-parallel parts, input features
for row-parallel ones; the model's `_shard_of` says where), and when every part of a fused projection is in, they are
stacked and installed. Raw tensors are dropped as soon as their linear is converted.

The experts of a mixture of experts are not projections: the model stacks them itself (models/moe_base.py). Asked to
(`quantize_model(..., quantized_experts=True)`, on CUDA, where the fused MoE kernels read FP8 and 4 bits), an FP8
method, or a 4-bit one without act-order, keeps them quantized: each expert's checkpoint tensors (or its 16-bit weight,
quantized here) become the method's layout, handed to the model's loader under `.weight`, `.weight_scale` (and
`.weight_zeros` for 4 bits). Otherwise quantized experts are dequantized here and load as 16-bit weights. Either way
an expert another expert-parallel rank holds is passed over unread.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from radixserve.model_runner.quantization.fp8 import Fp8Weight
from radixserve.model_runner.quantization.int4 import Int4Weight
from radixserve.model_runner.quantization.linear import QUANTIZED_PROJECTIONS, QuantizedLinear, swap_quantized_linears
from radixserve.model_runner.quantization.methods import Fp8Method, Int4Method, LinearMethod, QuantizedWeight

# Tensors some checkpoints carry beside a linear's required ones, which the layout does not need (or which a method
# that needs them lists among its suffixes).
OPTIONAL_SUFFIXES = ("weight_shape", "g_idx", "weight_g_idx", "input_scale")
# Suffixes that exist only on quantized linears: meeting one outside the quantized projections means a linear radixserve
# runs in 16 bits was quantized (the experts of a mixture of experts), and the loader dequantizes it.
_QUANTIZED_ONLY = ("weight_scale", "weight_scale_inv", "weight_packed", "weight_zero_point", "qweight", "qzeros",
                   "scales", "g_idx", "input_scale")
# safetensors' names of the FP8 dtypes: a `weight` stored so belongs to a quantized linear.
_FP8_STORAGE = ("F8_E4M3", "F8_E5M2")


def checkpoint_parts(model: nn.Module) -> dict[str, list[str]]:
    """For each projection of QUANTIZED_PROJECTIONS in the model, the checkpoint linears stacked into it, in order."""
    parts: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in QUANTIZED_PROJECTIONS:
            continue
        prefix = name[: -len(leaf)]
        stacked = sorted((index, part) for fused, part, index in model.stacked_projections if fused == leaf)
        parts[name] = [prefix + part for _, part in stacked] or [name]
    return parts


def quantize_model(model: nn.Module, method: LinearMethod, quantized_experts: bool = False) -> list[str]:
    """Swap the projections the method quantizes (the model on the meta device, before `to_empty`). With
    `quantized_experts`, the experts of a model whose loader takes them quantized stay in the method's format where
    the fused kernels read it and this rank's slice of them falls on whole blocks (see the module docstring)."""
    swapped = swap_quantized_linears(model, method, checkpoint_parts(model))
    if not quantized_experts or not getattr(model, "loads_quantized_experts", False):
        return swapped
    for name, module in model.named_modules():
        if not hasattr(module, "keep_fp8") or not method.quantizes(f"{name}.0.gate_proj"):
            continue
        if isinstance(method, Fp8Method):
            kept = module.keep_fp8(method.block)
        else:
            kept = isinstance(method, Int4Method) and not method.act_order and module.keep_int4(method.group_size)
        if kept:
            swapped.append(name)
    return swapped


class QuantizedWeightLoader:
    """Loads a checkpoint into a model prepared by `quantize_model`. With `dense`, the quantized linears' tensors are
    16-bit weights (`--quantization fp8` on a 16-bit checkpoint, or random weights) that the method quantizes.

    A quantized checkpoint linear outside the quantized projections (the experts of a mixture of experts, whose
    grouped kernels take 16-bit weights) is read in the method's format, dequantized, and loaded as its `weight`, in
    the model's dtype: the model computes with the dequantized values, and holds them in 16 bits."""

    def __init__(self, model: nn.Module, method: LinearMethod, dense: bool, device: torch.device) -> None:
        self.model, self.method, self.device = model, method, device
        self.required = ("weight",) if dense else method.suffixes
        self.dense = dense
        parts = checkpoint_parts(model)
        self.layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
        self.part_of = {hf: (name, index) for name in self.layers for index, hf in enumerate(parts[name])}
        self.num_parts = {name: len(parts[name]) for name in self.layers}
        self.raw: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint linear -> its tensors so far
        self.unprojected: dict[str, dict[str, torch.Tensor]] = {}  # the same, for quantized linears run in 16 bits
        self.converted: dict[str, dict[int, QuantizedWeight]] = {}  # projection -> its converted parts

    def load(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load every tensor; ValueError for a missing or unexpected one (as the model's own loader)."""
        self.model.load_weights(self._route(weights))
        missing = [name for name, layer in self.layers.items() if layer.weight_value is None]
        if missing:
            raise ValueError(f"checkpoint is missing quantized weights of {', '.join(missing[:5])}"
                             + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))

    def _route(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        expert_of = getattr(self.model, "expert_of", None)
        for name, tensor in weights:
            hf_linear, _, suffix = name.rpartition(".")
            expert = expert_of(f"{hf_linear}.weight") if expert_of is not None and suffix != "bias" else None
            if expert is not None:
                experts = self.model.get_submodule(expert[0])
                if not experts.shard.holds(expert[1]):
                    continue  # another expert-parallel rank's: neither read nor converted here
                if experts.scale_blocks is not None:
                    yield from self._quantized_expert(hf_linear, suffix, tensor)
                    continue
            if hf_linear not in self.part_of or suffix == "bias":
                if not self.dense and (suffix in _QUANTIZED_ONLY or (suffix == "weight" and _stored_fp8(tensor))):
                    tensors = self._collect(self.unprojected, hf_linear, suffix, tensor)
                    if tensors is not None:  # a quantized linear run in 16 bits: its dequantized (float32) weight
                        yield f"{hf_linear}.weight", self.method.from_checkpoint(
                            {k: v.to(self.device) for k, v in tensors.items()}).dequantize()
                    continue
                yield name, tensor
                continue
            tensors = self._collect(self.raw, hf_linear, suffix, tensor)
            if tensors is not None:
                self._convert(hf_linear, tensors)
        if self.unprojected:  # before the model's loader reports the weights they would have given as missing
            name, tensors = next(iter(self.unprojected.items()))
            raise ValueError(f"{self.method.name}: the checkpoint has {', '.join(sorted(tensors))} of {name} but not "
                             f"all of {', '.join(self.required)}" + (f" (and {len(self.unprojected) - 1} more such "
                                                                     "linears)" if len(self.unprojected) > 1 else ""))

    def _quantized_expert(self, hf_linear: str, suffix: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """An expert linear kept quantized: once its tensors are in (or its 16-bit weight, quantized), its weight, its
        scales (and zero points) as the model's loader takes them: FP8 `[N, K]` with scales per block or `[N, 1]` per
        row; 4 bits as `Int4Weight` holds them."""
        if self.dense:
            weight = self.method.from_dense(tensor[:].to(self.device))
        else:
            if suffix == "weight" and not _stored_fp8(tensor):
                raise ValueError(f"{self.method.name}: expert weight {hf_linear}.weight is stored in 16 bits, but the "
                                 f"checkpoint's {self.method.name} experts were expected")
            tensors = self._collect(self.unprojected, hf_linear, suffix, tensor)
            if tensors is None:
                return
            weight = self.method.from_checkpoint({k: v.to(self.device) for k, v in tensors.items()})
        if isinstance(weight, Int4Weight):
            weight = weight.finalized()
            if weight.g_idx is not None:
                raise ValueError(f"{self.method.name}: expert {hf_linear} orders its groups (act-order), which the "
                                 "4-bit experts' kernels do not")
            yield f"{hf_linear}.weight", weight.qweight
            yield f"{hf_linear}.weight_scale", weight.scales
            yield f"{hf_linear}.weight_zeros", weight.zeros
            return
        assert isinstance(weight, Fp8Weight)
        yield f"{hf_linear}.weight", weight.weight
        yield f"{hf_linear}.weight_scale", weight.scale if weight.block is not None else weight.scale[:, None]

    def _collect(self, store: dict[str, dict[str, torch.Tensor]], hf_linear: str, suffix: str,
                 tensor: Any) -> Optional[dict[str, torch.Tensor]]:
        """Add one tensor of checkpoint linear `hf_linear` to `store`; the linear's tensors, taken out of `store`,
        once all that the method needs are in, else None."""
        if suffix not in self.required and suffix not in OPTIONAL_SUFFIXES:
            raise ValueError(f"{self.method.name}: unexpected tensor {hf_linear}.{suffix} (a {self.method.name} linear "
                             f"holds {', '.join(self.required)})")
        tensors = store.setdefault(hf_linear, {})
        tensors[suffix] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if all(s in tensors for s in self.required) and self._has_extras(tensors):
            return store.pop(hf_linear)
        return None

    def _has_extras(self, tensors: dict[str, torch.Tensor]) -> bool:
        # An act-order checkpoint's g_idx must be in before the weight converts; others do not need it.
        needs_g_idx = getattr(self.method, "act_order", False) and not self.dense
        return not needs_g_idx or "g_idx" in tensors or "weight_g_idx" in tensors

    def _convert(self, hf_linear: str, tensors: dict[str, torch.Tensor]) -> None:
        name, index = self.part_of[hf_linear]
        layer = self.layers[name]
        if self.dense:
            weight = self.method.from_dense(tensors["weight"].to(self.device))
        else:
            weight = self.method.from_checkpoint({k: v.to(self.device) for k, v in tensors.items()})
        local_shape = self._local_shape(name, index, layer)
        shard = self.model._shard_of(f"{hf_linear}.weight", local_shape)
        if shard is not None:
            weight = weight.narrow(*shard)
        if tuple(weight.shape) != local_shape:
            raise ValueError(f"shape mismatch for {hf_linear}: checkpoint {tuple(weight.shape)} (this rank's part), "
                             f"model expects {local_shape}")
        parts = self.converted.setdefault(name, {})
        parts[index] = weight
        if len(parts) == self.num_parts[name]:
            ordered = [parts[i] for i in range(len(parts))]
            fused = ordered[0] if len(ordered) == 1 else type(ordered[0]).cat(ordered)
            layer.set_weight(_contiguous(fused))
            del self.converted[name]

    def _local_shape(self, name: str, index: int, layer: QuantizedLinear) -> tuple[int, int]:
        if self.num_parts[name] == 1:
            return layer.out_features, layer.in_features
        leaf = name.rsplit(".", 1)[-1]
        meta = torch.empty(layer.out_features, layer.in_features, device="meta")
        start, end = self.model._fused_rows(leaf, index, meta)
        return end - start, layer.in_features


def _stored_fp8(tensor: Any) -> bool:
    """Whether a checkpoint tensor (a tensor, or safetensors' lazy slice) is stored in an FP8 dtype."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    get_dtype = getattr(tensor, "get_dtype", None)
    return get_dtype is not None and get_dtype() in _FP8_STORAGE


def _contiguous(weight: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(weight, **{f.name: getattr(weight, f.name).contiguous()
                                          for f in dataclasses.fields(weight)
                                          if isinstance(getattr(weight, f.name), torch.Tensor)})
