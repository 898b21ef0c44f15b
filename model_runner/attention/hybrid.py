"""Decode on one attention backend, everything else on another (`--decode-attention-backend`, SGLang's flag).

On CUDA the default pairs FlashInfer's extends (its FA3 and FA2 prefill kernels, cascade attention) with the triton
backend's decode for batches of up to `DEFAULT_DECODE_MAX_BATCH` requests: a split-KV kernel that merges its splits
in the same launch and needs no planning on the host, so a captured decode step replays with nothing to prepare but
its inputs (FlashInfer plans every replay on the host, and merges its splits in a second kernel). In one call on an
H100, dummy weights, a 1024-token context, step from idle / back to back: Llama-3.1-8B at batch 1 6.16 / 5.99 ms
against 6.69 / 6.15 on FlashInfer alone, Qwen3-30B-A3B 4.13 / 3.90 against 5.02 / 4.15 (docs/benchmarks.md).

A decode batch goes to the extend backend where that backend would rather run it eagerly (FlashInfer's cascade over a
shared prefix saves more reads than a graph saves launches): the choice is a function of the batch, made the same way
when it is planned and at every layer. Captured decode graphs belong to the backend of their batch size.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.model_runner.attention.base import AttentionBackend
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode

# With no --decode-attention-backend, decode batches of up to this many requests take triton's kernel, larger ones
# flashinfer's. Llama-3.1-8B on an H100, a 1024-token context, step from idle / back to back (ms), triton against
# flashinfer: batch 64 9.31 / 9.11 against 10.41 / 9.57; batch 256 20.45 / 20.09 against 21.34 / 19.76 (under the
# overlap scheduler the host's planning hides, and back to back flashinfer's kernel is the faster there).
DEFAULT_DECODE_MAX_BATCH = 64


class HybridAttentionBackend(AttentionBackend):
    """`decode_max_batch`: decode batches of more requests stay on the extend backend (None: no limit)."""

    def __init__(self, extend: AttentionBackend, decode: AttentionBackend,
                 decode_max_batch: Optional[int] = None) -> None:
        self.extend = extend
        self.decode = decode
        self.decode_max_batch = decode_max_batch
        self.graphs_apply_windows = decode.graphs_apply_windows and (
            decode_max_batch is None or extend.graphs_apply_windows)
        self.min_shared_prefix = extend.min_shared_prefix

    @property
    def uses_prefix_groups(self) -> bool:  # the extend backend's cascade decides on the groups the scheduler finds
        return self.extend.uses_prefix_groups

    def _takes(self, batch_size: int) -> bool:
        return self.decode_max_batch is None or batch_size <= self.decode_max_batch

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        if batch.mode == ForwardMode.DECODE and self._takes(batch.batch_size) and not self.extend.prefers_eager(batch):
            return self.decode
        return self.extend

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and self.extend.prefers_eager(batch)

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        self.extend.warm_up(kv_dtype)
        self.decode.warm_up(kv_dtype)

    def plan(self, batch: ForwardBatch) -> None:
        self._for(batch).plan(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch, sliding_window: Optional[int] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._for(batch).forward(q, k, v, layer_id, scaling, batch, sliding_window, sinks)

    # ---- CUDA graphs (decode) --------------------------------------------------------------------
    # Each captured batch size belongs to one backend: the decode backend's up to `decode_max_batch`, the extend
    # backend's above it.
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self.decode.init_cuda_graph_state(max_bs if self._takes(max_bs) else self.decode_max_batch, max_context_len)
        if not self._takes(max_bs):
            self.extend.init_cuda_graph_state(max_bs, max_context_len)

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        (self.decode if self._takes(batch.batch_size) else self.extend).plan_for_capture(batch)

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        (self.decode if self._takes(batch.batch_size) else self.extend).plan_for_replay(batch)
