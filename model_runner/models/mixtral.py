"""Mixtral (8x7B, 8x22B): Llama's attention over a sparse feed-forward in every layer.

Routing: the top-k router logits, then a softmax over those. Checkpoints name the block `block_sparse_moe` and an
expert's gate, down and up projections `w1`, `w2`, `w3`; they are read under the Qwen-MoE names the shared layers use.
A `sliding_window` in the config caps the context length at the window (model_runner.py), as for Mistral.
"""

from __future__ import annotations

from typing import Iterable

import torch

from radixserve.model_runner.models.llama import LlamaDecoderLayer
from radixserve.model_runner.models.moe_base import MoEForCausalLM, rename_tensors, sparse_or_dense_mlp

CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."),
                      (".w3.", ".up_proj."))


class MixtralDecoderLayer(LlamaDecoderLayer):    make_mlp = staticmethod(sparse_or_dense_mlp)


class MixtralForCausalLM(MoEForCausalLM):
    layer_class = MixtralDecoderLayer
    checkpoint_renames = CHECKPOINT_RENAMES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        super().load_weights(rename_tensors(weights, CHECKPOINT_RENAMES), strict)
