"""The attention backend interface shared by torch_native, triton and flashinfer.

A backend is planned once per batch (`plan`), then called once per layer (`forward`). The model code
calls `forward` and never asks which backend it runs on.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    # Backends that read a shared prefix once per group set this; the scheduler then fills the decode batches'
    # `prefix_groups` (requests sharing at least `min_shared_prefix` cached positions).
    uses_prefix_groups = False
    min_shared_prefix = 0
    # Whether a captured decode CUDA graph applies the layers' sliding windows (else such models decode eagerly).
    graphs_apply_windows = True

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        """Whether `batch` should run eagerly even where a captured CUDA graph fits it."""
        return False

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        """Run once at start-up the kernels that only some batches use, so that their first use (which may
        compile them) does not stall a running server. Nothing by default."""

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata (index arrays, kernel plans) and store it on `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] of the new tokens
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
        sliding_window: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Write the new tokens' K/V at `batch.out_cache_loc`, then return causal attention output
        `[num_tokens, num_heads, head_dim]` over each request's prefix plus its new tokens (bidirectional when
        `batch.causal` is False, which only torch_native runs).

        A layer with a `sliding_window` W (the model passes it; None: full attention) attends from the query at
        position t only to the keys at positions t - W < p <= t, the W most recent (itself included), as Hugging
        Face's sliding layers do, and reads no KV slot of an older position: a window-aware pool may already have
        given those slots to another request.

        `sinks` (float32 `[num_heads]`, gpt-oss's attention sinks; None: none) adds one learned logit per head to
        every softmax's denominator, with no value: the output is the plain attention's times
        `sigmoid(lse - sink)`, `lse` the log-sum-exp of the row's scaled scores (`apply_sinks`)."""


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, lse_base2: bool = False) -> torch.Tensor:
    """Attention output `out [T, H, D]` whose softmax denominators also hold `exp(sinks[h])`, from the output without
    them and each row's log-sum-exp `lse [T, H]` (natural, or base 2 with `lse_base2`, as FlashInfer's):
    `sum_i exp(s_i) v_i / (sum_i exp(s_i) + exp(sink)) = out / (1 + exp(sink - lse)) = out * sigmoid(lse - sink)`.
    Computed in float32, returned in out's dtype; a row that saw no key (lse -inf) stays zero."""
    natural = lse.float() * math.log(2.0) if lse_base2 else lse.float()
    weight = torch.sigmoid(natural - sinks.float()[None, :])
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)
