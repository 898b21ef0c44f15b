"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, per `qkv_bias`) over a sparse
feed-forward with a shared expert.

Routing: softmax over the experts, top-k, renormalized only when `norm_topk_prob` (false in released checkpoints).
Every token also passes through the shared expert, scaled by `sigmoid(shared_expert_gate(x))`. Layers in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from radixserve.model_runner.models.llama import LlamaAttention, LlamaDecoderLayer
from radixserve.model_runner.models.moe_base import MoEForCausalLM, sparse_or_dense_mlp


class Qwen2MoeAttention(LlamaAttention):
    o_bias_override = False  # q/k/v biases follow config.attention_bias (the config's qkv_bias)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2MoeAttention
    make_mlp = staticmethod(sparse_or_dense_mlp)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen2MoeDecoderLayer
