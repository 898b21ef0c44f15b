"""Gemma 3 (text): the Llama decoder with Gemma's own norms, scales and attention pattern.

What differs from Llama (models/llama.py), as transformers' `Gemma3ForCausalLM` computes it:

- RMSNorm scales by `1 + weight` (weights are stored centred on 0), in float32, cast back after the product;
- four norms a layer: before and after attention, before and after the MLP; each sub-block's output is normed
  before it joins the residual stream;
- per-head RMSNorm of q and k before RoPE; scores scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
- embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype first;
- a GELU (tanh approximation) gated MLP;
- layers of `layer_types` "sliding_attention" attend within `sliding_window` and rotate with their own RoPE base
  (`rope_parameters["sliding_attention"]`, 10k by default), the full ones with the global base (1M) and scaling;
- logits soft-capped, `cap * tanh(logits / cap)`, where `final_logit_softcapping` is set; embeddings tied.

Gemma 3's `attn_logit_softcapping` is not applied by transformers' Gemma 3 attention either, so it is ignored here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.layers import RotaryEmbedding
from radixserve.model_runner.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from radixserve.model_runner.parallel import TPGroup, VocabParallelEmbedding

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.model_config import ModelConfig


class GemmaRMSNorm(nn.Module):
    """`x / rms(x) * (1 + weight)`, computed in float32 and cast to x's dtype at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhMLP(LlamaMLP):
    """`down(gelu_tanh(gate(x)) * up(x))` with gate and up fused, as Llama's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(config, layer_id, rotary, tp)
        self.scaling = float(config.hf_config.get("query_pre_attn_scalar", config.head_dim)) ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, rotary, tp)
        self.mlp = GeluTanhMLP(hidden, config.intermediate_size, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn_backend: "AttentionBackend") -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), batch, attn_backend)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, config: "ModelConfig", layer_class: type[nn.Module], max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size ** 0.5
        full_rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        sliding_rotary = full_rotary
        if config.sliding_rope_theta is not None:
            sliding_rotary = RotaryEmbedding(config.head_dim, max_positions, config.sliding_rope_theta,
                                             config.sliding_rope_scaling)
        self.layers = nn.ModuleList(
            layer_class(config, i, full_rotary if config.window_of(i) is None else sliding_rotary, tp)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                attn_backend: "AttentionBackend") -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        hidden = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, batch, attn_backend)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    model_class = Gemma3Model
    selects_rows = False  # Gemma3Model computes every token's final hidden state

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__(config, max_positions, tp)
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = super().compute_logits(hidden, batch)
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits
