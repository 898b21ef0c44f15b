"""CUDA graphs for decode: capture the model's decode forward once per batch size, then replay.

A decode step of a small batch launches hundreds of small kernels; from Python, launching them costs more
than running them. A CUDA graph records the launches of one forward pass and replays them with one call.
A graph is fixed in its shapes and its memory addresses, so:

- the graph reads its inputs from static buffers (`DecodeInputBuffers`) sized for the largest captured
  batch; a replay copies the real batch into their first rows;
- graphs exist for a set of batch sizes (`capture_batch_sizes`); a batch runs in the graph of the next
  captured size (`padded_batch_size`, by bisection) and the spare rows hold a harmless padding request;
- the attention backend keeps its per-batch plan in fixed buffers that it rewrites before each replay
  (`GraphCapturableAttention`);
- the logits come back in the graph's own output buffer: valid until the next replay.

All graphs share one memory pool; they are captured from the largest batch down so the smaller ones
reuse its memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.model_runner.runner_parts import RunnerParts
    from radixserve.radix_cache.pool import ReqToTokenPool, TokenToKVPool

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
# On a GPU of at least LARGE_GPU_BYTES the graphs go up to LARGE_GPU_MAX_BS: at batch ~1000 an eager decode
# step's kernel launches are host work as long as the GPU's own, and on a slower host the step waits for
# them (docs/benchmarks/history/gpu.md, "Capturing larger decode batches").
LARGE_GPU_BYTES = 64 << 30
LARGE_GPU_MAX_BS = 1024
# Padding request: token 0 at position 0 in request row 0, one position long (row 0, position 0 always
# holds some valid slot index, so reading it is safe), writing its K/V to the pool's dummy slot 0.
PADDING_SLOT = 0
PADDING_ROW = 0
# Eager runs before each capture: compile Triton kernels, create cuBLAS handles and lazily built tables
# (RoPE cos/sin on the device) outside the capture, where allocations and host syncs are allowed.
WARMUP_RUNS = 2


@runtime_checkable
class GraphCapturableAttention(Protocol):
    """What an attention backend provides so decode batches can run in CUDA graphs.

    The graph runner calls `init_cuda_graph_state` once, then for each captured size `plan_for_capture`
    on its static batch (outside the capture), and before every replay `plan_for_replay` on the same
    static batch object, whose device tensors then hold the new values and whose host lists
    (`seq_lens_cpu`, ...) mirror them. Whatever the captured kernels read must stay at fixed addresses:
    `plan_for_replay` may only rewrite buffers in place.
    """

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None: ...

    def plan_for_capture(self, batch: ForwardBatch) -> None: ...

    def plan_for_replay(self, batch: ForwardBatch) -> None: ...


def supports_cuda_graph(backend: object) -> bool:
    return isinstance(backend, GraphCapturableAttention)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Ascending batch sizes to capture, ending at `max_bs`: fine steps where padding would waste most
    (small batches), then every 16."""
    assert max_bs >= 1, f"max_bs must be >= 1, got {max_bs}"
    candidates = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, max_bs + 1, 16))
    sizes = sorted({bs for bs in candidates if bs < max_bs} | {max_bs})
    return sizes


def padded_batch_size(batch_size: int, captured: Sequence[int]) -> Optional[int]:
    """The smallest captured size >= `batch_size` (`captured` ascending), or None when it is too large."""
    index = bisect.bisect_left(captured, batch_size)
    return captured[index] if index < len(captured) else None


class DecodeInputBuffers:
    """The fixed device tensors captured decode graphs read their inputs from, for up to `max_bs` requests.

    `batch_view(bs)` is a DECODE ForwardBatch over the first `bs` rows; `load(batch, view)` puts a real
    batch into the first rows of a view and the padding request into the rest. Positions double as the
    prefix lengths (a decode request's prefix is everything before its new token).
    """

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.max_bs = max_bs
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((max_bs,), PADDING_SLOT, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((max_bs,), PADDING_ROW, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        # A pool whose window layers have slots of their own (radix_cache/swa_pool.py): where those layers write; the
        # padding rows write the window space's dummy slot.
        self.window_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # Rows [0, _num_dirty) may hold a real request's values; every row after them holds padding.
        self._num_dirty = 0

    def batch_view(
        self, bs: int, req_to_token_pool: "ReqToTokenPool", token_to_kv_pool: "TokenToKVPool"
    ) -> ForwardBatch:
        assert 1 <= bs <= self.max_bs
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.positions[:bs],
            extend_lens=self.extend_lens[:bs],
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            window_cache_loc=(None if getattr(token_to_kv_pool, "window_map", None) is None
                              else self.window_cache_loc[:bs]),
        )

    def load(self, batch: ForwardBatch, view: ForwardBatch) -> None:
        """Copy decode `batch` into the first rows of `view` (a `batch_view` of at least its size) and make
        sure every other row of the view holds the padding request, on the current stream."""
        assert batch.mode == ForwardMode.DECODE, "only decode batches run in CUDA graphs"
        bs, padded = batch.batch_size, view.batch_size
        assert bs <= padded, f"batch of {bs} does not fit a view of {padded}"
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        if view.window_cache_loc is not None:  # window slots: a decode token's row names its own slot, so its window
            # slot is the map's
            self.window_cache_loc[:bs].copy_(view.token_to_kv_pool.window_map[batch.out_cache_loc], non_blocking=True)
        # Rows a larger earlier batch left behind would otherwise write K/V into slots that may now belong
        # to other requests: reset them (only when the batch shrank, so a steady batch costs nothing).
        stale_end = min(self._num_dirty, padded)
        if stale_end > bs:
            self.input_ids[bs:stale_end].zero_()
            self.positions[bs:stale_end].zero_()
            self.out_cache_loc[bs:stale_end].fill_(PADDING_SLOT)
            self.req_pool_indices[bs:stale_end].fill_(PADDING_ROW)
            self.seq_lens[bs:stale_end].fill_(1)
            self.window_cache_loc[bs:stale_end].zero_()
        self._num_dirty = bs if self._num_dirty <= padded else self._num_dirty
        pad = padded - bs
        view.seq_lens_cpu = list(batch.seq_lens_cpu) + [1] * pad
        view.prefix_lens_cpu = list(batch.prefix_lens_cpu) + [0] * pad
        view.extend_lens_cpu = [1] * padded


class CudaGraphRunner:
    """Captured decode graphs of one ModelRunner, for `batch_sizes` (ascending).

    Construction captures every size (the runner's model, KV pools and a `GraphCapturableAttention`
    backend must be ready). `can_run(batch)` says whether `replay(batch)` applies: a DECODE batch no larger
    than the largest captured size that wants the default logits (each request's token).
    """

    def __init__(self, runner: "RunnerParts", batch_sizes: Sequence[int]) -> None:
        assert runner.device.type == "cuda", "CUDA graphs need a CUDA device"
        backend = runner.attn_backend
        assert supports_cuda_graph(backend), f"{type(backend).__name__} cannot run in CUDA graphs"
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.model = runner.model
        self.attn_backend = backend
        self.buffers = DecodeInputBuffers(self.max_bs, runner.device)
        self._req_to_token_pool = runner.req_to_token_pool
        self._token_to_kv_pool = runner.token_to_kv_pool
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._views: dict[int, ForwardBatch] = {}
        # Every graph writes its logits into rows of this one buffer (a batch reads them before the next replay);
        # a buffer per graph would hold a [bs, vocab] float32 block per captured size: 17 GiB for Llama 3's
        # vocabulary and sizes up to 1024.
        self._logits: Optional[torch.Tensor] = None
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle()
        backend.init_cuda_graph_state(self.max_bs, runner.req_to_token_pool.max_context_len)
        self._capture_all(runner.device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode == ForwardMode.DECODE
            and batch.batch_size <= self.max_bs
            and batch.logits_indices is None
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[batch_size, vocab]` of decode `batch`, a view of the graph's output buffer that
        the next replay overwrites; writes the batch's new K/V into the pool like an eager forward."""
        padded = padded_batch_size(batch.batch_size, self.batch_sizes)
        assert padded is not None and self.can_run(batch), "batch cannot run in a captured graph"
        view = self._views[padded]
        self.buffers.load(batch, view)
        self.attn_backend.plan_for_replay(view)
        self._graphs[padded].replay()
        return self._outputs[padded][: batch.batch_size]

    # ---- capture -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        for bs in reversed(self.batch_sizes):
            self._capture(bs, stream)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s (%.2f GiB)",
                    self.batch_sizes, time.perf_counter() - started, used / (1 << 30))

    def _capture(self, bs: int, stream: torch.cuda.Stream) -> None:
        view = self.buffers.batch_view(bs, self._req_to_token_pool, self._token_to_kv_pool)
        with torch.cuda.stream(stream):
            self.attn_backend.plan_for_capture(view)
            for _ in range(WARMUP_RUNS):
                logits = self._forward(view)
            if self._logits is None:  # the first capture is the largest (see _capture_all)
                self._logits = torch.empty((self.max_bs, logits.shape[1]), dtype=logits.dtype, device=logits.device)
            del logits
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._logits[:bs].copy_(self._forward(view))
        self._graphs[bs] = graph
        self._views[bs] = view
        self._outputs[bs] = self._logits[:bs]

    def _forward(self, view: ForwardBatch) -> torch.Tensor:
        hidden = self.model(view.input_ids, view.positions, view)
        return self.model.compute_logits(hidden, view)


def graph_max_batch_size(runner: "RunnerParts") -> int:
    """The largest decode batch to capture for `runner` (see `choose_graph_max_batch_size`)."""
    return choose_graph_max_batch_size(runner.config.cuda_graph_max_bs,
                                       torch.cuda.get_device_properties(runner.device).total_memory,
                                       runner.max_running_requests)


def choose_graph_max_batch_size(requested: Optional[int], gpu_bytes: int, max_running_requests: int) -> int:
    """`--cuda-graph-max-bs` when given, else LARGE_GPU_MAX_BS on a GPU of at least LARGE_GPU_BYTES and
    DEFAULT_MAX_BS on a smaller one; at most `max_running_requests`."""
    if requested is None:
        requested = LARGE_GPU_MAX_BS if gpu_bytes >= LARGE_GPU_BYTES else DEFAULT_MAX_BS
    return max(1, min(requested, max_running_requests))


def create_cuda_graph_runner(runner: "RunnerParts") -> Optional[CudaGraphRunner]:
    """The decode graphs for `runner` (on CUDA, CUDA graphs not disabled), or None with a warning when its
    attention backend cannot be captured. Sizes: `capture_batch_sizes` up to `graph_max_batch_size`."""
    backend = runner.attn_backend
    if not supports_cuda_graph(backend):
        logger.warning("the %s attention backend cannot run in CUDA graphs; decode runs eagerly",
                       type(backend).__name__)
        return None
    return CudaGraphRunner(runner, capture_batch_sizes(graph_max_batch_size(runner)))
