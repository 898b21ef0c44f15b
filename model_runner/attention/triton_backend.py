"""The Triton attention backend: paged decode and extend kernels that read KV through `req_to_token`.

Works for any page size (the kernels address KV per token slot). On the GPU the kernels are compiled; on
a CPU they run under the Triton interpreter, which must be enabled with `TRITON_INTERPRET=1` before
`triton` is first imported (that is how the tests run it; it is far too slow to serve with).

A pool whose window layers have slots of their own (radix_cache/swa_pool.py): the decode kernel reads a window
layer's slots through the pool's map itself (so captured decode graphs apply it too); extends read a table of the
batch's rows translated into window slots (`WindowTable`, built once per batch).

`row_invariant` (deterministic inference, model_runner/batch_invariant.py): every query row, of a prefill or a
decode, is computed by the decode kernel as a request of its own whose length ends at that row, with one split. A
row's bits then depend on its own positions only: not on the batch, on where its prompt was cut into chunks, or on how
much of it came from the cache.

Attention sinks (gpt-oss) join the softmax's denominator inside the kernels: at the end of the extend kernel's online
softmax, and in the decode kernel's merge of its splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from radixserve.kernels.triton_attention import decode_attention, extend_attention
from radixserve.model_runner.attention.base import AttentionBackend
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.radix_cache.pool import FLOAT8_DTYPES

# A CPU "device" here is the interpreter: enough programs to exercise the split-KV path, no more.
_CPU_TARGET_PROGRAMS = 16


@dataclass
class WindowTable:
    """The batch's `req_to_token` rows in window slots: request i's row is `table[rows[i]]` (rows = 0..batch-1).
    Only the positions some window of the batch reads are filled (from the largest window back from each request's
    first new token); the others stay at the dummy slot, which no kernel reads."""

    table: torch.Tensor  # [batch, max seq_len] int32
    rows: torch.Tensor  # [batch] int64

    @classmethod
    def of(cls, batch: ForwardBatch, window: int) -> "WindowTable":
        device = batch.req_pool_indices.device
        starts = (batch.prefix_lens - window + 1).clamp(min=0)
        lengths = batch.seq_lens - starts
        entry = torch.repeat_interleave(torch.arange(batch.batch_size, device=device), lengths)
        offsets = torch.cumsum(lengths, 0) - lengths
        positions = starts[entry] + torch.arange(entry.numel(), device=device) - offsets[entry]
        full = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[entry], positions]
        table = torch.zeros(batch.batch_size, max(batch.seq_lens_cpu), dtype=torch.int32, device=device)
        table[entry, positions] = batch.token_to_kv_pool.window_map[full.to(torch.int64)].to(torch.int32)
        return cls(table, torch.arange(batch.batch_size, dtype=torch.int64, device=device))


@dataclass
class TritonDecodeMetadata:
    num_kv_splits: int  # a power of two that depends only on the batch size (graph-capture friendly)


@dataclass
class TritonRowsMetadata:
    """Row-invariant extend: new token t is a decode query over positions [0, seq_lens[t]) of row rows[t]."""

    rows: torch.Tensor  # [new tokens] int64: the request's req_to_token row
    seq_lens: torch.Tensor  # [new tokens] int64: the token's position + 1


@dataclass
class TritonExtendMetadata:
    extend_starts: torch.Tensor  # [batch] int64: each request's first row among the new tokens
    max_extend_len: int
    window: Optional[WindowTable] = None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton for EXTEND, MIXED (through extend) and DECODE batches.

    Decode splits each request's positions into `num_kv_splits` shares, computes one partial result per
    (request, KV head, share) and merges them; the split count grows as the batch shrinks so a small batch
    still fills the device (one share with `row_invariant`). Scratch for the partial results is allocated once, for
    `max_batch_size`. A decode batch's new K/V are written by the attention kernel itself (`decode_attention`'s
    `new_kv`: one launch a layer fewer) where they go to the slots `req_to_token` names (not a window layer's own slot
    space) in the pool's dtype (a float8 pool takes the pool's rounding); `store_new_kv = False` writes them first
    through the pool, as the extend batches do.
    """

    store_new_kv = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: Union[str, torch.device],
        max_batch_size: int,
        max_kv_splits: int = 16,
        row_invariant: bool = False,
    ) -> None:
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert max_kv_splits >= 1 and max_kv_splits & (max_kv_splits - 1) == 0, "max_kv_splits: a power of 2"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_kv_splits = max_kv_splits
        self.row_invariant = row_invariant
        if self.device.type == "cuda":
            self._target_programs = 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self._target_programs = _CPU_TARGET_PROGRAMS
        # Split-KV scratch, flat: a decode batch of b requests uses b * num_kv_splits(b) rows of it, which the split
        # count keeps near the target below max_batch_size requests (so not max_batch_size * max_kv_splits rows).
        self._scratch_rows = max(max_batch_size, *(b * self.num_kv_splits(b) for b in range(1, max_batch_size + 1)))
        self._partial_out = torch.empty(self._scratch_rows * num_heads * head_dim, dtype=torch.float32,
                                        device=self.device)
        self._partial_lse = torch.empty(self._scratch_rows * num_heads, dtype=torch.float32, device=self.device)

    def num_kv_splits(self, batch_size: int) -> int:
        """Largest power of two <= max_kv_splits that keeps batch * kv_heads * splits near the target
        program count. Shares a request cannot fill stay empty and cost one early-exiting program. One with
        `row_invariant`: the shares' boundaries would move with the batch size."""
        splits = 1
        if self.row_invariant:
            return splits
        while splits < self.max_kv_splits and batch_size * self.num_kv_heads * splits * 2 <= self._target_programs:
            splits *= 2
        return splits

    def plan(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            assert batch.batch_size <= self.max_batch_size, "decode batch larger than max_batch_size"
            batch.attn_metadata = TritonDecodeMetadata(self.num_kv_splits(batch.batch_size))
        elif self.row_invariant:
            requests = torch.arange(batch.batch_size, device=batch.extend_lens.device)
            entry = torch.repeat_interleave(requests, batch.extend_lens)
            offsets = torch.cumsum(batch.extend_lens, dim=0) - batch.extend_lens
            first_new = batch.prefix_lens.to(torch.int64) - offsets.to(torch.int64)
            batch.attn_metadata = TritonRowsMetadata(
                batch.req_pool_indices[entry].to(torch.int64),
                first_new[entry] + torch.arange(entry.numel(), device=entry.device) + 1,
            )
        else:
            extend_starts = torch.cumsum(batch.extend_lens, dim=0) - batch.extend_lens
            batch.attn_metadata = TritonExtendMetadata(extend_starts, max(batch.extend_lens_cpu, default=0))
            pool = batch.token_to_kv_pool
            if pool.window_map is not None:
                batch.attn_metadata.window = WindowTable.of(batch, max(pool.window_sizes))

    # ---- CUDA graphs (decode) --------------------------------------------------------------------
    # The decode kernels read every per-request value (rows, lengths) from device tensors and their launch
    # shape depends only on the batch size, so a captured decode needs no re-planning.
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Check that the split-KV scratch covers graphs of up to `max_bs` requests."""
        assert max_bs <= self.max_batch_size, (
            f"CUDA graphs for {max_bs} requests exceed the backend's max_batch_size {self.max_batch_size}"
        )

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        """Plan the graph runner's static decode batch once, before its capture."""
        assert batch.mode == ForwardMode.DECODE, "only decode batches are captured"
        self.plan(batch)

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        """Nothing to do: the metadata planned at capture depends only on the (fixed) batch size."""

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
        pool = batch.token_to_kv_pool
        meta = batch.attn_metadata
        window_layer = pool.is_window_layer(layer_id)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        new_kv = None
        if (isinstance(meta, TritonDecodeMetadata) and self.store_new_kv and not window_layer
                and k.dtype == v.dtype == k_buffer.dtype and k.stride(-1) == 1 and v.stride(-1) == 1):
            new_kv = (k, v, batch.kv_write_loc(layer_id))  # the decode kernel writes them
        else:
            pool.set_kv_buffer(layer_id, batch.kv_write_loc(layer_id), k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        # The kernels read q and KV in one dtype (float8 KV is read as q's); cast q to the KV dtype otherwise and
        # the result back.
        q_kv = q if q.dtype == k_buffer.dtype or k_buffer.dtype in FLOAT8_DTYPES else q.to(k_buffer.dtype)
        out = torch.empty_like(q_kv)
        req_to_token, rows = batch.req_to_token_pool.req_to_token, batch.req_pool_indices
        if isinstance(meta, TritonDecodeMetadata):
            partial_out, partial_lse = self._scratch(batch.batch_size, meta.num_kv_splits)
            decode_attention(
                q_kv, k_buffer, v_buffer, out, req_to_token, rows, batch.seq_lens, scaling,
                partial_out, partial_lse, meta.num_kv_splits, sliding_window,
                pool.window_map if window_layer else None, sinks, new_kv=new_kv,
            )
        elif isinstance(meta, TritonRowsMetadata):
            self._rows_as_decodes(q_kv, k_buffer, v_buffer, out, req_to_token, meta, scaling, sliding_window,
                                  pool.window_map if window_layer else None, sinks)
        else:
            assert isinstance(meta, TritonExtendMetadata), "plan() must run before forward()"
            if meta.window is not None and window_layer:
                req_to_token, rows = meta.window.table, meta.window.rows
            extend_attention(
                q_kv, k_buffer, v_buffer, out, req_to_token, rows, batch.prefix_lens,
                batch.extend_lens, meta.extend_starts, meta.max_extend_len, scaling, sliding_window, sinks,
            )
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def _scratch(self, requests: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-KV scratch viewed as `[requests, heads, splits, head_dim]` and `[requests, heads, splits]`."""
        rows = requests * splits
        assert rows <= self._scratch_rows, "decode batch beyond the scratch"
        heads, head_dim = self.num_heads, self.head_dim
        return (self._partial_out[: rows * heads * head_dim].view(requests, heads, splits, head_dim),
                self._partial_lse[: rows * heads].view(requests, heads, splits))

    def _rows_as_decodes(self, q, k_buffer, v_buffer, out, req_to_token, meta: TritonRowsMetadata, scaling: float,
                         window: Optional[int], slot_map: Optional[torch.Tensor],
                         sinks: Optional[torch.Tensor]) -> None:
        """Row-invariant extend: the new tokens as decode queries of one split, as many per launch as the decode
        scratch holds."""
        capacity = self._scratch_rows
        partial_out, partial_lse = self._scratch(capacity, 1)
        for start in range(0, q.shape[0], capacity):
            end = min(start + capacity, q.shape[0])
            decode_attention(
                q[start:end], k_buffer, v_buffer, out[start:end], req_to_token, meta.rows[start:end],
                meta.seq_lens[start:end], scaling, partial_out, partial_lse, 1, window, slot_map, sinks,
            )
