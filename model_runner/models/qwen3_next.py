"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5's hybrid decoder (models/qwen3_5.py) over Qwen's sparse feed-forward.

The token mixers are Qwen3.5's: Gated DeltaNet on the `layer_types` "linear_attention" layers, gated full attention
with per-head q/k norms and partial RoPE (a quarter of each head by default) on the others, every RMSNorm scaling by
`1 + weight`. The feed-forward is Qwen2-MoE's sparse block on the layers `decoder_sparse_step` and `mlp_only_layers`
select (softmax routing, top-k renormalized when `norm_topk_prob`, a shared expert scaled by a sigmoid gate), a dense
MLP of `intermediate_size` elsewhere.

What differs is the checkpoint: a linear layer's input projection is stored as two matrices, `in_proj_qkvz` and
`in_proj_ba`, whose rows are grouped per key head. For key head h, serving value heads `h*G .. h*G + G - 1`
(`G = num_value_heads // num_key_heads`):

    in_proj_qkvz rows:  [ q_h (Dk) | k_h (Dk) | v of its G value heads (G*Dv) | z of them (G*Dv) ]  for h = 0 .. Hk-1
    in_proj_ba rows:    [ b of its G value heads | a of them ]                                       for h = 0 .. Hk-1

The loader regroups those rows into the layer's one `in_proj` as `[q | k | v | z | b | a]`, each over all heads in
order: the layout Qwen3.5 stores and `GatedDeltaNet` computes with, so the forward pass is Qwen3.5's unchanged.
Tensor parallelism is not supported for this family yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.model_runner.models.moe_base import expert_tensor_parts, load_expert_tensor, sparse_or_dense_mlp
from radixserve.model_runner.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, copy_checked

if TYPE_CHECKING:
    from radixserve.model_runner.linear_attention import GatedDeltaNet

# Qwen3.5's four input projections of a linear layer, and the Qwen3-Next tensor each comes from.
_SPLIT_PROJECTIONS = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
                      "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    make_mlp = staticmethod(sparse_or_dense_mlp)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's hybrid causal LM with sparse feed-forward layers, loading Qwen3-Next's checkpoint layout."""

    layer_class = Qwen3NextDecoderLayer

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model loads, by Hugging Face name, with its shape: Qwen3.5's, with the four
        input projections of a linear layer as Qwen3-Next's two and the stacked experts as one tensor per expert."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().hf_weight_shapes().items():
            prefix, _, leaf = name.rpartition(".linear_attn.")
            projection = leaf.removesuffix(".weight")
            if projection in _SPLIT_PROJECTIONS:
                fused = f"{prefix}.linear_attn.{_SPLIT_PROJECTIONS[projection]}.weight"
                rows = shapes.get(fused, (0,))[0] + shape[0]
                shapes[fused] = (rows,) + tuple(shape[1:])
            elif name.endswith(".experts.w13_weight"):
                experts, (num_experts, gate_up, hidden) = name.removesuffix(".w13_weight"), shape
                for e in range(num_experts):
                    shapes[f"{experts}.{e}.gate_proj.weight"] = (gate_up // 2, hidden)
                    shapes[f"{experts}.{e}.up_proj.weight"] = (gate_up // 2, hidden)
            elif name.endswith(".experts.w2_weight"):
                experts, (num_experts, hidden, intermediate) = name.removesuffix(".w2_weight"), shape
                for e in range(num_experts):
                    shapes[f"{experts}.{e}.down_proj.weight"] = (hidden, intermediate)
            else:
                shapes[name] = shape
        return shapes

    def _load_tensor(self, hf_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> None:
        name = hf_name.removeprefix("model.")
        parts = expert_tensor_parts(name)
        if parts is not None:
            prefix, expert, projection = parts
            if f"{prefix}.w13_weight" not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
            load_expert_tensor(self.get_submodule(prefix), hf_name, expert, projection, tensor)
            return
        prefix, _, leaf = name.rpartition(".linear_attn.")
        if leaf in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
            if f"{prefix}.linear_attn.in_proj.weight" not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
            layer: "GatedDeltaNet" = self.get_submodule(f"{prefix}.linear_attn")
            in_proj = layer.in_proj.weight.data
            qkvz_rows = layer.conv_dim + layer.value_size
            if leaf == "in_proj_qkvz.weight":
                copy_checked(hf_name, regroup_qkvz(tensor, layer, hf_name), in_proj[:qkvz_rows])
            else:
                copy_checked(hf_name, regroup_ba(tensor, layer, hf_name), in_proj[qkvz_rows:])
            return
        super()._load_tensor(hf_name, tensor, params)


def _regroup(tensor: torch.Tensor, num_key_heads: int, sizes: list[int], hf_name: str) -> torch.Tensor:
    """Rows grouped per key head as `sizes` (one group of rows per head) -> the same parts over all heads, part after
    part."""
    if tensor.dim() != 2 or tensor.shape[0] != num_key_heads * sum(sizes):
        raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, model expects "
                         f"({num_key_heads * sum(sizes)}, hidden)")
    per_head = tensor.reshape(num_key_heads, sum(sizes), tensor.shape[1]).split(sizes, dim=1)
    return torch.cat([part.reshape(-1, tensor.shape[1]) for part in per_head])


def regroup_qkvz(tensor: torch.Tensor, layer: "GatedDeltaNet", hf_name: str) -> torch.Tensor:
    """`in_proj_qkvz` `[Hk*(2Dk + 2G*Dv), hidden]` (rows per key head) -> `[q | k | v | z]` rows over all heads."""
    group_values = layer.num_v_heads // layer.num_k_heads * layer.v_dim
    return _regroup(tensor, layer.num_k_heads, [layer.k_dim, layer.k_dim, group_values, group_values], hf_name)


def regroup_ba(tensor: torch.Tensor, layer: "GatedDeltaNet", hf_name: str) -> torch.Tensor:
    """`in_proj_ba` `[Hk*2G, hidden]` (rows per key head) -> `[b | a]` rows over all value heads."""
    group = layer.num_v_heads // layer.num_k_heads
    return _regroup(tensor, layer.num_k_heads, [group, group], hf_name)
