"""Deterministic inference on a GPU (`--enable-deterministic-inference`): which parts of the forward pass change, and
which models it covers.

A request's bits may depend only on the request. On a GPU three kinds of kernel break that by default:
- GEMMs: cuBLAS picks its tiles and a split of the reduction by the row count. Every projection and the LM head run
  instead through kernels/batch_invariant_matmul.py (fixed tiles, the reduction never split): `BatchInvariantLinear`,
  swapped in for the model's linears after its weights are loaded (it holds the same weight tensors, so weight
  updates reach it).
- attention: FlashInfer's split-KV decode and its prefill tiles depend on the batch and on where a prompt was cut
  (chunks, cache hits). The triton backend's row-invariant mode (model_runner/attention/triton_backend.py) computes
  every query row, prefill or decode, as a decode row with one split over its own positions.
- reductions over a row (norms, log-softmax): the Triton RMSNorm runs one program per row already, and the sampler
  takes logprobs row by row (model_runner/sampling.py).
Elementwise kernels (rotary, SiLU-and-mul, residual adds) and the embedding gather are invariant as they are.

Not covered on a GPU, refused at start-up with the reason: tensor parallelism (the all-reduce's order), quantized
linears, LoRA, mixtures of experts (the fused MoE kernel tiles by the tokens each expert receives) and the
linear-attention hybrids (their chunked kernels cut at chunk boundaries).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.model_runner.model_config import ModelConfig


def check_gpu_deterministic(model_config: ModelConfig) -> None:
    """ValueError, with the reason, for a model whose forward pass has no batch-invariant path on a GPU."""
    if model_config.moe is not None:
        raise ValueError(f"--enable-deterministic-inference on a GPU covers dense models; {model_config.architecture} "
                         "is a mixture of experts, whose fused kernel tiles by the tokens each expert receives")
    if model_config.is_hybrid:
        raise ValueError(f"--enable-deterministic-inference on a GPU covers attention-only models; "
                         f"{model_config.architecture} has linear-attention layers, whose chunked kernels are not "
                         "batch-invariant")


class BatchInvariantLinear(nn.Module):
    """`x @ weight.T (+ bias)` through the batch-invariant GEMM; `weight` and `bias` are the replaced layer's own
    tensors."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from radixserve.kernels.batch_invariant_matmul import batch_invariant_linear

        return batch_invariant_linear(x, self.weight, self.bias)


def use_batch_invariant_linears(model: nn.Module) -> int:
    """Replace `model`'s projections (`nn.Linear`, and `RowParallelLinear` on one rank) by `BatchInvariantLinear`,
    and give the LM head one (`model.logits_head`, which `compute_logits` reads first). Returns how many were
    replaced."""
    from radixserve.model_runner.parallel import plain_linears

    targets = plain_linears(model)
    for _, parent, name, child in targets:
        setattr(parent, name, BatchInvariantLinear(child.weight, child.bias))
    if hasattr(model, "logits_head"):
        head = getattr(model, "lm_head", None)  # the replacement above, or None where the embedding is tied
        model.logits_head = head if isinstance(head, BatchInvariantLinear) else BatchInvariantLinear(
            model.lm_head_weight, None)
    return len(targets)
