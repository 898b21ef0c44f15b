"""Qwen3 (dense): the Llama decoder plus an RMSNorm over each head of q and of k, applied before RoPE (one launch
with it on CUDA, `RotaryEmbedding.with_head_norms`).

The projection biases follow `config.attention_bias` (false in released checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.model_runner.layers import RMSNorm, RotaryEmbedding
from radixserve.model_runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.model_runner.parallel import TPGroup


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: "TPGroup") -> None:
        super().__init__(config, layer_id, rotary, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.with_head_norms(positions, q, k, self.q_norm, self.k_norm)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
