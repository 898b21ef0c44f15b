"""The FlashInfer attention backend (the default on CUDA): paged decode and causal paged prefill.

Per batch, `plan` builds the page table on the device from `req_to_token` (a Triton kernel, no host
loop) and plans one FlashInfer wrapper; per layer, `forward` writes the new K/V into the pool and runs the
planned wrapper over the pool's buffers viewed as NHD pages. Extend (and MIXED) batches run as paged
prefill over prefix + new tokens together, causally: one kernel, no separate ragged pass and merge. On Hopper,
extend batches of at least `FA3_MIN_MEAN_EXTEND` new tokens a request run on FlashInfer's FA3 kernels (compiled
at start-up), shorter ones and every other GPU on its FA2 kernels.

Decode under CUDA graphs (`init_cuda_graph_state`, `plan_for_capture`, `plan_for_replay`): one decode
wrapper per captured batch size, in FlashInfer's CUDA-graph mode, whose page table lives in fixed buffers
shared by all sizes (one graph runs at a time); re-planning before each replay rewrites those buffers and
the wrapper's own scheduling workspace in place, which the captured kernels read.

Decode batches whose requests share long cached prefixes (`ForwardBatch.prefix_groups`) run as cascade attention
(`flashinfer_cascade.py`), each group's shared keys read once, unless `cascade=False` (`--disable-cascade-attn`).

Sliding windows: a model whose layers have windows names them (`sliding_windows`); per batch, each window that some
sequence outgrows gets a wrapper of its own, planned with FlashInfer's `window_left` (W - 1) over a page table that
starts at the page of each request's first new token's window, so no older page is read (a window-aware pool may
have freed it). Such models run without cascade attention and without decode CUDA graphs.

Attention sinks (gpt-oss): the wrappers return each row's base-2 log-sum-exp beside the output, and the sink's share
of the softmax is taken out of the output after it (`base.apply_sinks`), so no kernel changes.

`flashinfer` is imported when the backend is constructed, never when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from radixserve.kernels import flashinfer_wrappers as fi
from radixserve.kernels.kv_indices import PagedKVIndex, build_paged_kv_index
from radixserve.model_runner.attention.base import AttentionBackend, apply_sinks
from radixserve.model_runner.attention.flashinfer_cascade import (
    MIN_SAVED_BYTES,
    MIN_SAVED_BYTES_OVER_GRAPH,
    MIN_SHARED_POSITIONS,
    CascadeMetadata,
    cascade_pays,
    plan_cascade,
    run_cascade,
    warm_up_cascade,
)
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode


# New tokens per request (mean over an extend batch) from which FlashInfer's FA3 prefill kernels beat its FA2 ones
# on an H200 (`benchmarks/gpu_kernels.py extend`: 64 requests on a 2,048-position prefix, one layer of the 8B
# shape: 128 new tokens 0.65 against 0.97 ms, 64 new 0.62 against 0.46; FA3's time hardly falls below 64).
FA3_MIN_MEAN_EXTEND = 128


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned decode or prefill wrapper
    kv_index: PagedKVIndex  # kept alive while the wrapper reads its page ids
    # Sliding window -> the plan of its layers, for each window some sequence of the batch outgrows.
    windowed: dict[int, "FlashInferMetadata"] = field(default_factory=dict)


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer on one CUDA device.

    `dtype` is the dtype of q (the model's activations); the KV dtype is read from the pool at plan
    time. FlashInfer fixes the softmax scale when planning: `sm_scale` (default `head_dim ** -0.5`) is
    planned, and a layer called with another `scaling` has its queries rescaled to match.

    `prefill_backend`: "auto" (FA3 for long extends where `fa3_available`, else FA2), "fa2", or "fa3" (every
    extend batch on FA3; Hopper only). Cascade and decode never use FA3 (it lost 3-5x on one query a request).
    """

    graphs_apply_windows = False  # the graph wrappers are planned for full attention only

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        page_size: int = 1,
        sm_scale: Optional[float] = None,
        decode_use_tensor_cores: Optional[bool] = None,
        prefill_backend: str = "auto",
        workspace_bytes: int = fi.DEFAULT_WORKSPACE_BYTES,
        cascade: bool = True,
        sliding_windows: Sequence[int] = (),
    ) -> None:
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.device = torch.device(device)
        assert self.device.type == "cuda", "the flashinfer backend needs a CUDA device"
        fi.require_flashinfer()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.page_size = page_size
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
        if decode_use_tensor_cores is None:
            # Several query heads per KV head make decode a small matrix product per KV head.
            decode_use_tensor_cores = num_heads // num_kv_heads >= 4
        self.decode_use_tensor_cores = decode_use_tensor_cores
        self._workspace = fi.new_workspace(self.device, workspace_bytes)
        self._decode_wrapper = fi.make_decode_wrapper(self._workspace, decode_use_tensor_cores)
        if prefill_backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"prefill_backend must be auto, fa2 or fa3, not {prefill_backend!r}")
        fa3 = fi.fa3_available(self.device, dtype, head_dim)
        if prefill_backend == "fa3" and not fa3:
            raise ValueError(f"FlashInfer's fa3 prefill kernels need a Hopper GPU, 16-bit activations and a head size "
                             f"of {', '.join(map(str, fi.FA3_HEAD_DIMS))} (this model's is {head_dim})")
        self._prefill_wrapper = fi.make_prefill_wrapper(self._workspace, "fa2")
        self._fa3_prefill_wrapper = None
        if prefill_backend == "fa3" or (prefill_backend == "auto" and fa3):
            self._fa3_prefill_wrapper = fi.make_prefill_wrapper(self._workspace, "fa3")
        self.fa3_min_mean_extend = 0 if prefill_backend == "fa3" else FA3_MIN_MEAN_EXTEND
        self._planned: Optional[torch.cuda.Event] = None  # recorded after the latest plan's copies
        self._graph_wrappers: dict[int, Any] = {}  # captured batch size -> CUDA-graph decode wrapper
        self.sliding_windows = tuple(sorted(set(sliding_windows)))
        self.cascade = cascade and not self.sliding_windows
        self.min_shared_prefix = MIN_SHARED_POSITIONS
        self.cascade_min_saved_bytes = MIN_SAVED_BYTES  # per step, see flashinfer_cascade.py
        self.cascade_min_saved_bytes_over_graph = MIN_SAVED_BYTES_OVER_GRAPH
        self._shared_prefill_wrapper = fi.make_prefill_wrapper(self._workspace, "fa2") if self.cascade else None
        self.num_cascade_batches = 0
        # Per window: (decode wrapper, prefill wrapper) of its layers.
        self._window_wrappers = {window: (fi.make_decode_wrapper(self._workspace, self.decode_use_tensor_cores),
                                          fi.make_prefill_wrapper(self._workspace, "fa2"))
                                 for window in self.sliding_windows}

    def plan(self, batch: ForwardBatch) -> None:
        assert batch.token_to_kv_pool.page_size == self.page_size, "pool page size differs from the backend's"
        self._wait_for_previous_plan()
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        kv_dtype = batch.token_to_kv_pool.dtype
        if self.cascade and cascade_pays(batch, self.cascade_min_saved_bytes):
            cascade = plan_cascade(batch, self._shared_prefill_wrapper, self._decode_wrapper, shape, self.dtype,
                                   self.sm_scale)
            if cascade is not None:
                self._mark_planned()
                self.num_cascade_batches += 1
                batch.attn_metadata = cascade
                return
        kv_index = self._kv_index(batch)
        qo_indptr_host = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        qo_indptr_host[1:] = torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), dim=0)
        if batch.mode == ForwardMode.DECODE:
            fi.plan_decode(self._decode_wrapper, kv_index, *shape, self.dtype, kv_dtype, self.sm_scale)
            wrapper = self._decode_wrapper
        else:
            wrapper = self._extend_wrapper(batch, kv_dtype)
            fi.plan_prefill(wrapper, qo_indptr_host, kv_index, *shape, self.dtype, kv_dtype, self.sm_scale)
        meta = FlashInferMetadata(wrapper, kv_index)
        own_window_slots = batch.token_to_kv_pool.window_map is not None
        for window in self.sliding_windows:
            if max(batch.seq_lens_cpu) > window or own_window_slots:
                meta.windowed[window] = self._plan_window(batch, window, qo_indptr_host, shape, kv_dtype)
        self._mark_planned()
        batch.attn_metadata = meta

    def _plan_window(self, batch: ForwardBatch, window: int, qo_indptr_host: torch.Tensor, shape: tuple,
                     kv_dtype: torch.dtype) -> FlashInferMetadata:
        """The plan of the layers with a sliding `window`: pages from each request's first new token's window on."""
        starts = [max(0, prefix - window + 1) // self.page_size * self.page_size for prefix in batch.prefix_lens_cpu]
        kv_index = self._kv_index(batch, starts)
        window_map = batch.token_to_kv_pool.window_map
        if window_map is not None:  # the window layers' own slot space (radix_cache/swa_pool.py; page size 1)
            kv_index.indices = window_map[kv_index.indices.to(torch.int64)].to(torch.int32)
        decode_wrapper, prefill_wrapper = self._window_wrappers[window]
        if batch.mode == ForwardMode.DECODE:
            fi.plan_decode(decode_wrapper, kv_index, *shape, self.dtype, kv_dtype, self.sm_scale, window - 1)
            return FlashInferMetadata(decode_wrapper, kv_index)
        fi.plan_prefill(prefill_wrapper, qo_indptr_host, kv_index, *shape, self.dtype, kv_dtype, self.sm_scale,
                        window_left=window - 1)
        return FlashInferMetadata(prefill_wrapper, kv_index)

    def _extend_wrapper(self, batch: ForwardBatch, kv_dtype: torch.dtype) -> Any:
        """FA3 for an extend batch long enough to gain from it (and a pool in the activations' dtype), else FA2."""
        if (self._fa3_prefill_wrapper is not None and kv_dtype == self.dtype
                and sum(batch.extend_lens_cpu) >= self.fa3_min_mean_extend * batch.batch_size):
            return self._fa3_prefill_wrapper
        return self._prefill_wrapper

    @property
    def uses_prefix_groups(self) -> bool:  # the scheduler then fills `prefix_groups` of decode batches
        return self.cascade

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        if self._fa3_prefill_wrapper is not None and kv_dtype == self.dtype:
            self._warm_up_fa3()
        if self.cascade:
            shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
            warm_up_cascade(self._shared_prefill_wrapper, self._decode_wrapper, shape, self.dtype, kv_dtype,
                            self.sm_scale, self.device)

    def _warm_up_fa3(self) -> None:
        """One FA3 extend of one request on dummy tensors: its kernels compile at their first use on a new machine,
        which would otherwise stall the first long prompt of a running server."""
        length = max(self.fa3_min_mean_extend, 1)
        pages = -(-length // self.page_size)
        req_to_token = torch.arange(pages * self.page_size, dtype=torch.int32, device=self.device)[None]
        kv_index = build_paged_kv_index(req_to_token, torch.zeros(1, dtype=torch.int64, device=self.device),
                                        torch.tensor([length], device=self.device), [length], self.page_size)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        fi.plan_prefill(self._fa3_prefill_wrapper, torch.tensor([0, length], dtype=torch.int32), kv_index, *shape,
                        self.dtype, self.dtype, self.sm_scale)
        buffer = torch.zeros(pages * self.page_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                             device=self.device)
        q = torch.zeros(length, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        fi.run_paged(self._fa3_prefill_wrapper, q, buffer, buffer, self.page_size)
        torch.cuda.synchronize(self.device)

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        """Whether `batch` should skip its CUDA graph: cascade attention saves more reads than the graph saves
        launches."""
        return self.cascade and cascade_pays(batch, self.cascade_min_saved_bytes_over_graph)

    def _wait_for_previous_plan(self) -> None:
        """A plan writes a pinned host buffer and queues its copy to the device. The overlap scheduler
        plans batch N+1 while batch N is queued, possibly before the device ran N's copy: wait for it."""
        if self._planned is not None:
            self._planned.synchronize()

    def _mark_planned(self) -> None:
        self._planned = torch.cuda.Event()
        self._planned.record()

    # ---- CUDA graphs (decode) --------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the fixed page-table buffers for decode graphs of up to `max_bs` requests of up to
        `max_context_len` positions each."""
        max_pages = max_bs * -(-max_context_len // self.page_size)
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_wrappers = {}

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        """Make the CUDA-graph decode wrapper of `batch.batch_size` and plan it for `batch` (the graph
        runner's static batch, outside the capture)."""
        assert batch.mode == ForwardMode.DECODE, "only decode batches are captured"
        bs = batch.batch_size
        flashinfer = fi.require_flashinfer()
        self._graph_wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.decode_use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self.plan_for_replay(batch)

    def _kv_index(self, batch: ForwardBatch, starts: Optional[list[int]] = None) -> PagedKVIndex:
        """The batch's paged-KV index arrays, built on the device from req_to_token (from positions `starts` on,
        whole pages, where given)."""
        return build_paged_kv_index(
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.seq_lens_cpu,
            self.page_size,
            starts,
        )

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        """Re-plan the captured wrapper of `batch.batch_size` for the values now in the static batch
        (host work plus copies into the fixed buffers, queued on the current stream before the replay)."""
        wrapper = self._graph_wrappers[batch.batch_size]
        kv_index = self._kv_index(batch)
        self._wait_for_previous_plan()
        fi.plan_decode(
            wrapper, kv_index, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            self.dtype, batch.token_to_kv_pool.dtype, self.sm_scale,
        )
        self._mark_planned()
        batch.attn_metadata = FlashInferMetadata(wrapper, kv_index)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
        sliding_window: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, (FlashInferMetadata, CascadeMetadata)), "plan() must run before forward()"
        pool = batch.token_to_kv_pool
        if sliding_window is not None and (max(batch.seq_lens_cpu) > sliding_window or pool.window_map is not None):
            assert sliding_window in self.sliding_windows, f"window {sliding_window} was not given to the backend"
            meta = meta.windowed[sliding_window]
        pool.set_kv_buffer(layer_id, batch.kv_write_loc(layer_id), k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        out_dtype = q.dtype
        if abs(scaling - self.sm_scale) > 1e-12 * abs(self.sm_scale):
            q = q * (scaling / self.sm_scale)
        q = q.to(self.dtype).contiguous()
        if sinks is not None:  # the base-2 log-sum-exp of the scores FlashInfer saw: q's scale is the planned one
            if isinstance(meta, CascadeMetadata):
                out, lse = run_cascade(meta, q, k_buffer, v_buffer, self.page_size, return_lse=True)
            else:
                out, lse = fi.run_paged(meta.wrapper, q, k_buffer, v_buffer, self.page_size, return_lse=True)
            out = apply_sinks(out, lse, sinks, lse_base2=True)
        elif isinstance(meta, CascadeMetadata):
            out = run_cascade(meta, q, k_buffer, v_buffer, self.page_size)
        else:
            out = fi.run_paged(meta.wrapper, q, k_buffer, v_buffer, self.page_size)
        return out if out.dtype == out_dtype else out.to(out_dtype)
