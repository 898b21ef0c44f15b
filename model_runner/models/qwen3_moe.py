"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) over a sparse feed-forward.

Routing: softmax over the experts, top-k, renormalized when `norm_topk_prob` (true in released checkpoints). Layers in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from radixserve.model_runner.models.moe_base import MoEForCausalLM, sparse_or_dense_mlp
from radixserve.model_runner.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    make_mlp = staticmethod(sparse_or_dense_mlp)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
