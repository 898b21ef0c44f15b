"""Thin wrappers over FlashInfer's paged attention (flashinfer-python 0.6.x), imported lazily.

Nothing here imports `flashinfer` at module import time, so the package stays importable on machines
without it (CPU, CI); `require_flashinfer()` raises a clear ImportError when it is missing.

KV layout: our per-layer buffers `[slots, kv_heads, head_dim]` with `slot = page * page_size + offset`
are exactly FlashInfer's "NHD" paged layout `[pages, page_size, kv_heads, head_dim]` once viewed that
way (`paged_kv_view`); page ids in the page table are absolute, page 0 being the pool's dummy page.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from radixserve.kernels.kv_indices import PagedKVIndex

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV scratch size


def flashinfer_available() -> bool:
    """True when `flashinfer` can be imported and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        require_flashinfer()
    except ImportError:
        return False
    return True


def require_flashinfer() -> ModuleType:
    """The `flashinfer` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            "the flashinfer attention backend needs flashinfer-python (pip install 'radixserve[gpu]'); "
            "use --attention-backend triton or torch_native without it"
        ) from exc


def new_workspace(device: torch.device, nbytes: int = DEFAULT_WORKSPACE_BYTES) -> torch.Tensor:
    """Zeroed float workspace (FlashInfer requires zeros on first use); share one between wrappers that
    never run concurrently."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def make_decode_wrapper(workspace: torch.Tensor, use_tensor_cores: bool) -> Any:
    """A `BatchDecodeWithPagedKVCacheWrapper` over the NHD layout. Tensor cores pay off once several
    query heads share a KV head (they then run through the prefill kernels)."""
    flashinfer = require_flashinfer()
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)


# The head sizes FlashInfer's FA3 (Hopper) prefill kernels are built for; other sizes prefill on FA2.
FA3_HEAD_DIMS = (64, 128, 256)
# FA2's smallest head size: below it its prefill finds no valid tile (fewer than four 16-wide MMA columns a head) and
# fails at its first plan with "Invalid configuration".
MIN_HEAD_DIM = 64


def fa3_available(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> bool:
    """Whether FlashInfer's FA3 prefill kernels run here: Hopper (compute capability 9.x), 16-bit activations and a
    head size of `FA3_HEAD_DIMS` (its kernels for others do not compile)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and dtype in (torch.bfloat16, torch.float16) and head_dim in FA3_HEAD_DIMS)


def make_prefill_wrapper(workspace: torch.Tensor, backend: str = "fa2") -> Any:
    """A `BatchPrefillWithPagedKVCacheWrapper` over the NHD layout."""
    flashinfer = require_flashinfer()
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)


def paged_kv_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a `[slots, kv_heads, head_dim]` buffer as `[pages, page_size, kv_heads, head_dim]` (no copy)."""
    num_pages = buffer.shape[0] // page_size
    return buffer[: num_pages * page_size].view(num_pages, page_size, buffer.shape[1], buffer.shape[2])


def plan_decode(
    wrapper: Any,
    index: PagedKVIndex,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    sm_scale: float,
    window_left: int = -1,
) -> None:
    """Plan one decode batch. The host mirrors of indptr / last_page_len are passed so that FlashInfer's
    planner (which reads them on the host) needs no device-to-host copy; the page ids stay on the device.
    `window_left` >= 0: the query sees only the keys at most that many positions before it (-1: all)."""
    wrapper.plan(
        index.indptr_host,
        index.indices,
        index.last_page_len_host,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        sm_scale=sm_scale,
        window_left=window_left,
    )


def plan_prefill(
    wrapper: Any,
    qo_indptr_host: torch.Tensor,
    index: PagedKVIndex,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    sm_scale: float,
    causal: bool = True,
    window_left: int = -1,
) -> None:
    """Plan one extend batch as causal paged prefill over prefix + new tokens (whose K/V are in the pool
    before `run`). FlashInfer aligns the causal mask bottom-right, so new token j of a request with
    prefix p sees positions 0..p + j (p + j - window_left..p + j with `window_left` >= 0). With `causal=False`
    every query sees all of its request's pages."""
    wrapper.plan(
        qo_indptr_host,
        index.indptr_host,
        index.indices,
        index.last_page_len_host,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal=causal,
        pos_encoding_mode="NONE",
        sm_scale=sm_scale,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        window_left=window_left,
    )


def run_paged(
    wrapper: Any, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_size: int,
    return_lse: bool = False,
) -> Any:
    """Run a planned decode or prefill wrapper for one layer; returns `[num_tokens, num_heads, head_dim]`, and
    with `return_lse` also the base-2 log-sum-exp of each query's scores `[num_tokens, num_heads]` (float32)."""
    kv = (paged_kv_view(k_buffer, page_size), paged_kv_view(v_buffer, page_size))
    return wrapper.run(q, kv, return_lse=True) if return_lse else wrapper.run(q, kv)
