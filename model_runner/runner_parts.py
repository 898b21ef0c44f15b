"""`RunnerParts`: what the runner's helpers read of a ModelRunner.

The attention backends, the decode CUDA graphs, the start-up memory profile and the static generation helper are
given the runner that owns them; they are typed against this Protocol rather than the ModelRunner class, so they
do not import the module that imports them (model_runner.py holds the one implementation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

if TYPE_CHECKING:
    from radixserve.model_runner.forward_batch import ForwardBatch
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.model_runner.parallel import HeadLayout
    from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
    from radixserve.model_runner.cpu.dispatch import CpuKernels
    from radixserve.model_runner.runner_config import RunnerConfig


class RunnerParts(Protocol):
    config: "RunnerConfig"
    cpu_kernels: "CpuKernels"
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    page_size: int
    context_len: int
    vocab_size: int
    max_running_requests: int
    model_config: "ModelConfig"
    head_layout: "HeadLayout"
    model: Any  # the model of model_runner/models/, with set_attention_backend and compute_logits
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "TokenToKVPool"
    allocator: "KVAllocator"
    attn_backend: Any  # an attention.base.AttentionBackend (the attention package builds on this module)
    lora_manager: Optional[Any]
    cuda_graph_runner: Optional[Any]

    def forward(self, batch: "ForwardBatch", use_cuda_graph: bool = True) -> torch.Tensor: ...
