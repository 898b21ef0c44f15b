"""A Llama-family model's decoder layers in one C++ call for decode batches on GGUF blocks
(kernels/cpu_decode_layers.cpp).

On two cores a decode step of the embedded SmolLM2 spends as long in the layers' Python around its kernels
(splits, views, the attention backend's checks, about 300 calls through torch's dispatcher) as in its attention and
norms together. `FusedDecodeLayers` runs the same kernels in the same order from C++, so its output equals the
layers' bit for bit (tests/model_runner/test_fused_decode.py), and the Python is paid once a step.

`use_fused_decode_layers` installs it on a model whose every layer is a Llama, Qwen2 (q/k/v biases) or Qwen3 (per-head
q/k norms) decoder layer with the gated MLP, no sinks and no sliding window, with all four projections on GGUF blocks
(model_runner/cpu/gguf_linear.py), on one rank. A batch takes it when the blocks' kernel computes every projection
at its size (interleaved blocks at any size, others below `DENSE_FROM` tokens, from which
a float linear takes over: the one kept beside the blocks by default, or the dequantized weight's), asks for every
token's hidden state, and the CPU attention backend planned it for
its kernel; any other batch runs the layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan, kernel_dtypes
from radixserve.model_runner.cpu.gguf_linear import DENSE_FROM, GGUFLinear
from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from radixserve.model_runner.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer
from radixserve.model_runner.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend

# the decoder layers the C++ loop computes exactly: (layer class, its attention class)
_COVERED = {LlamaDecoderLayer: LlamaAttention, Qwen2DecoderLayer: Qwen2Attention, Qwen3DecoderLayer: Qwen3Attention}
_NONE = torch.empty(0)  # a bias or q/k norm weight the model does not have


class FusedDecodeLayers:
    """Callable `(positions, hidden, batch, attn_backend) -> (mlp_out, residual)` of the last layer, or None where
    the batch must run the layers (see the module docstring)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scaling = first.scaling
        self.rotary = first.rotary
        self.eps = layers[0].input_layernorm.eps
        self.layer_ids = [layer.self_attn.layer_id for layer in layers]
        self.weights: list[torch.Tensor] = []
        self.types: list[int] = []
        self.activation_bits: list[int] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norms = [attn.q_norm.weight, attn.k_norm.weight] if hasattr(attn, "q_norm") else [_NONE, _NONE]
            qkv_bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else _NONE
            self.weights += [layer.input_layernorm.weight, attn.qkv_proj.blocks, qkv_bias, attn.o_proj.blocks,
                             layer.post_attention_layernorm.weight, mlp.gate_up_proj.blocks, mlp.down_proj.blocks,
                             *qk_norms]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self.types.append(linear.kernel_type)
                self.activation_bits.append(linear.activation_bits)
        # Interleaved blocks compute every row count on the kernel called here; other blocks
        # hand many rows to a float linear (kept, or the dequantized weight's), so from DENSE_FROM tokens on those
        # batches run the layers.
        every_row = all(linear.every_row for layer in layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.max_tokens = None if every_row else DENSE_FROM - 1

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                 attn_backend: "AttentionBackend") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        plan = batch.attn_metadata
        pool = batch.token_to_kv_pool
        if ((self.max_tokens is not None and hidden.shape[0] > self.max_tokens) or hidden.dtype != torch.float32
                or not isinstance(attn_backend, CpuAttentionBackend) or not isinstance(plan, CpuAttentionPlan)
                or not kernel_dtypes(hidden.dtype, pool.k_buffer[0].dtype)):
            return None
        buffers = [pool.get_kv_buffer(layer_id) for layer_id in self.layer_ids]
        hidden, residual = torch.ops.radixserve_cpu.decode_layers(
            hidden, positions, self.weights, self.types, self.activation_bits, self.rotary.cos, self.rotary.sin,
            [k for k, _ in buffers], [v for _, v in buffers],
            [plan.out_cache_loc, plan.items, plan.group_member_indptr, plan.group_kv_indptr, plan.member_q_start,
             plan.member_q_len, plan.member_q_pos0, plan.member_kv_indptr, plan.member_kv_pos0, plan.kv_slots],
            self.scaling, self.eps, self.num_heads, self.num_kv_heads, self.head_dim, attn_backend.amx,
            attn_backend.row_invariant)
        return hidden, residual


def _covered_layer_on_blocks(layer: nn.Module) -> bool:
    if _COVERED.get(type(layer)) is not type(layer.self_attn):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not LlamaMLP or attn.sliding_window is not None:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (all(type(linear) is GGUFLinear for linear in linears) and attn.o_proj.bias is None
            and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None)


def _eps(layer: nn.Module) -> set[float]:
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [layer.self_attn.q_norm, layer.self_attn.k_norm] if hasattr(layer.self_attn, "q_norm") else []
    return {norm.eps for norm in norms}


def use_fused_decode_layers(model: nn.Module) -> bool:
    """Install `FusedDecodeLayers` on `model` (`model.model.fused_decode`) where it applies (see the module
    docstring); returns whether it did."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if (layers is None or len(layers) == 0 or not hasattr(inner, "fused_decode") or model.tp.size != 1
            or not all(_covered_layer_on_blocks(layer) for layer in layers) or not cpu_build.ready()):
        return False
    first = layers[0].self_attn
    if any((layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.rotary)
           != (first.num_heads, first.num_kv_heads, first.head_dim, first.rotary) for layer in layers):
        return False
    if len(set().union(*(_eps(layer) for layer in layers))) != 1:  # the loop takes one epsilon for every norm
        return False
    inner.fused_decode = FusedDecodeLayers(layers)
    return True
