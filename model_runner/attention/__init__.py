"""Attention backends behind one interface (`AttentionBackend`), chosen by name.

Backend modules are imported only when chosen, so importing this package pulls in neither Triton nor
FlashInfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.model_runner.attention.base import AttentionBackend
from radixserve.runtime.wire.attention_backends import ATTENTION_BACKENDS, device_refusal

if TYPE_CHECKING:
    from radixserve.model_runner.runner_parts import RunnerParts

# Deterministic inference: a shared prefix this long never occurs, so every request is a group of its own.
BATCH_INVARIANT_PREFIX = 1 << 62


def create_attention_backend(name: str, runner: "RunnerParts | None" = None) -> AttentionBackend:
    """The backend called `name`, built for `runner` (model shapes, device, dtype, page size, pool sizes).

    `torch_native` needs no runner. Raises ValueError for an unknown name, or for a backend that cannot run
    here (triton or flashinfer without CUDA, or without their package), with the reason.
    """
    if name == "torch_native":
        from radixserve.model_runner.attention.torch_native import TorchNativeAttention

        return TorchNativeAttention()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if runner is None:
        raise ValueError(f"the {name} attention backend is built for a ModelRunner; none was given")
    config = runner.model_config
    shape = (runner.head_layout.num_heads, runner.head_layout.num_kv_heads, config.head_dim)  # this rank's heads
    if name == "flashinfer":
        from radixserve.kernels.flashinfer_wrappers import MIN_HEAD_DIM

        if config.layer_kv_shapes:
            raise ValueError("the flashinfer attention backend plans one KV shape for every layer, and this model's "
                             "layers differ; use the triton or torch_native attention backend")
        if config.head_dim < MIN_HEAD_DIM:
            raise ValueError(f"the flashinfer attention backend has no kernels for this model's head size of "
                             f"{config.head_dim} (its smallest is {MIN_HEAD_DIM}); use the triton attention backend")
    if config.layer_kv_shapes:  # the Triton scratch holds the widest layer's heads
        shape = (shape[0], shape[1], max(head_dim for _, head_dim in config.layer_kv_shapes))
    refusal = device_refusal(name, runner.device.type)
    if refusal is not None:
        raise ValueError(refusal)
    if name == "cpu":
        from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend

        if runner.cpu_kernels.batch_invariant:  # every request alone (no shared-prefix group that depends on the
            # batch), every row as a decode row (no path that depends on how many rows an item holds)
            return CpuAttentionBackend(amx=runner.cpu_kernels.amx_attention, min_shared_prefix=BATCH_INVARIANT_PREFIX,
                                       row_invariant=True)
        return CpuAttentionBackend(amx=runner.cpu_kernels.amx_attention)
    if name == "triton":
        try:
            from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"the triton attention backend is not available: {exc}") from exc
        return TritonAttentionBackend(*shape, runner.device, max_batch_size=runner.req_to_token_pool.size,
                                      row_invariant=runner.config.deterministic)
    # flashinfer
    try:
        from radixserve.kernels.flashinfer_wrappers import DEFAULT_WORKSPACE_BYTES
        from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend
        from radixserve.model_runner.cuda_graph import graph_max_batch_size

        # Split-KV decode scratch grows with the batch: 128 MB per 128 requests of the largest captured batch
        # (the largest uncaptured batches plan within it too).
        graph_bs = graph_max_batch_size(runner)
        workspace = DEFAULT_WORKSPACE_BYTES * max(1, graph_bs // 128)
        prefill = {None: "auto", "flashinfer": "fa2", "fa3": "fa3"}[runner.config.prefill_attention_backend]
        return FlashInferAttentionBackend(*shape, runner.dtype, runner.device, page_size=runner.page_size,
                                          workspace_bytes=workspace, prefill_backend=prefill,
                                          cascade=not runner.config.disable_cascade_attn,
                                          sliding_windows=config.sliding_windows)
    except ImportError as exc:
        raise ValueError(f"the flashinfer attention backend is not available: {exc}") from exc


__all__ = ["AttentionBackend", "ATTENTION_BACKENDS", "create_attention_backend"]
