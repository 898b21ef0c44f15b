"""Paged attention in plain PyTorch: the reference backend, for CPU and GPU.

Per batch, `plan` splits the requests into chunks of consecutive requests and, per chunk, gathers the KV slot
indices `req_to_token[row, :seq_len]` into a padded `[requests, max_seq_len]` table and builds the causal
mask. Per layer, `forward` writes the new tokens' K/V into the pool, then for each chunk gathers the K/V
through that table and runs `scaled_dot_product_attention` once per KV head: the query heads sharing a KV
head are folded into the query-row dimension, so K and V are never repeated for grouped-query attention.

Why chunks: one padded batch over all requests costs one call per layer but pads every request to the
longest one and gathers one large K/V copy that falls out of the CPU caches (measured 3x slower than a
loop over requests at 64 requests x 1000 tokens); one call per request wastes nothing but pays Python and
dispatch overhead per request and layer (2-7x slower than one padded call for 8-128 short decodes). A
chunk grows while its padded (query, key) pairs stay under `max_chunk_pairs` (which also bounds its
gathered K/V rows) and under `max_padding_waste` times its real pairs. On CPU, decode batches form chunks
of a few thousand KV rows, short prompts are batched and long prompts run one by one; on a GPU a batch is
usually one chunk. EXTEND, DECODE and MIXED batches all take this one path.

Causality: new token j of request i sits at position `prefix_lens[i] + j` and attends to key positions
`<= prefix_lens[i] + j`. Padded key columns point at slot 0 (the pool's dummy page) and are masked out;
padded query rows see the whole sequence (so no row is empty) and their output is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from radixserve.model_runner.attention.base import AttentionBackend
from radixserve.model_runner.forward_batch import ForwardBatch

# Chunk limits per device type: (max padded (query, key) pairs per chunk, max padding waste). CPU values
# measured with SmolLM2-135M head shapes (9 query heads, 3 KV heads, head_dim 64). On a GPU every call
# costs launches rather than cache misses, so chunks are as large as memory for the mask comfortably allows
# (one padded call: about 2x faster than per-request calls for 32 decodes of 1k tokens on an H200).
CHUNK_LIMITS = {"cpu": (2048, 2.0), "cuda": (1 << 24, 4.0)}


@dataclass
class AttentionChunk:
    """Consecutive requests attended in one call. Their new tokens are `[token_start, token_end)` of the
    batch (tokens are concatenated in request order)."""

    token_start: int
    token_end: int
    num_requests: int
    max_extend_len: int
    kv_indices: torch.Tensor  # [requests, max_seq_len] int64 KV slots; padding -> slot 0
    mask: torch.Tensor  # [requests, 1, max_extend_len, max_seq_len] bool, True = attend
    # Row of each new token in the [requests * max_extend_len] query grid; None when no padding is needed.
    query_slots: Optional[torch.Tensor]
    _grouped_masks: dict = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask with each query row repeated `group` times (see `_group_queries`), built once."""
        if self.max_extend_len == 1:  # one mask row broadcasts over the group's query rows
            return self.mask
        if group not in self._grouped_masks:
            self._grouped_masks[group] = self.mask.repeat_interleave(group, dim=2)
        return self._grouped_masks[group]


@dataclass
class TorchNativeMetadata:
    chunks: list[AttentionChunk]


class TorchNativeAttention(AttentionBackend):
    """Reference attention backend; correct for EXTEND, DECODE and MIXED batches of any lengths.

    Limits left as None take `CHUNK_LIMITS` of the batch's device type. `max_chunk_pairs=0` runs request by
    request; both limits at infinity run one padded batch.
    """

    def __init__(self, max_chunk_pairs: Optional[float] = None, max_padding_waste: Optional[float] = None) -> None:
        self.max_chunk_pairs = max_chunk_pairs
        self.max_padding_waste = max_padding_waste

    # ---- planning --------------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        chunks = []
        token_start = 0
        device_type = batch.req_pool_indices.device.type
        for first, last in self.split_requests(batch.extend_lens_cpu, batch.seq_lens_cpu, device_type):
            chunk = _plan_chunk(batch, first, last, token_start)
            chunks.append(chunk)
            token_start = chunk.token_end
        batch.attn_metadata = TorchNativeMetadata(chunks)

    def split_requests(
        self, extend_lens: list[int], seq_lens: list[int], device_type: str = "cpu"
    ) -> list[tuple[int, int]]:
        """Request ranges `[first, last)` of the chunks, grown greedily in batch order."""
        default_pairs, default_waste = CHUNK_LIMITS.get(device_type, CHUNK_LIMITS["cuda"])
        max_pairs = default_pairs if self.max_chunk_pairs is None else self.max_chunk_pairs
        max_waste = default_waste if self.max_padding_waste is None else self.max_padding_waste
        ranges = []
        first, num_requests = 0, len(seq_lens)
        while first < num_requests:
            last = first + 1
            max_ext, max_seq, real_work = extend_lens[first], seq_lens[first], extend_lens[first] * seq_lens[first]
            while last < num_requests:
                ext, seq = max(max_ext, extend_lens[last]), max(max_seq, seq_lens[last])
                work = real_work + extend_lens[last] * seq_lens[last]
                padded_pairs = (last + 1 - first) * ext * seq
                if padded_pairs > max_pairs or padded_pairs > max_waste * work:
                    break
                max_ext, max_seq, real_work = ext, seq, work
                last += 1
            ranges.append((first, last))
            first = last
        return ranges

    # ---- per layer -------------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = batch.attn_metadata
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        if len(meta.chunks) == 1:
            return _attend_chunk(q, k_buffer, v_buffer, meta.chunks[0], scaling)
        out = torch.empty_like(q)
        for chunk in meta.chunks:
            queries = q[chunk.token_start:chunk.token_end]
            out[chunk.token_start:chunk.token_end] = _attend_chunk(queries, k_buffer, v_buffer, chunk, scaling)
        return out


def _plan_chunk(batch: ForwardBatch, first: int, last: int, token_start: int) -> AttentionChunk:
    device = batch.req_pool_indices.device
    extend_lens = batch.extend_lens_cpu[first:last]
    max_ext, max_seq = max(extend_lens), max(batch.seq_lens_cpu[first:last])
    key_pos = torch.arange(max_seq, device=device)
    in_seq = key_pos[None, :] < batch.seq_lens[first:last, None]  # [n, max_seq]
    rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[first:last], :max_seq].to(torch.int64)
    kv_indices = torch.where(in_seq, rows, torch.zeros_like(rows))
    query_pos = batch.prefix_lens[first:last, None] + torch.arange(max_ext, device=device)[None, :]
    causal = key_pos[None, None, :] <= query_pos[:, :, None]  # [n, max_ext, max_seq]
    mask = (causal & in_seq[:, None, :])[:, None]
    query_slots = None
    if any(e != max_ext for e in extend_lens):
        slots = [r * max_ext + j for r, e in enumerate(extend_lens) for j in range(e)]
        query_slots = torch.tensor(slots, dtype=torch.int64, device=device)
    return AttentionChunk(
        token_start, token_start + sum(extend_lens), last - first, max_ext, kv_indices, mask, query_slots
    )


def _attend_chunk(q, k_buffer, v_buffer, chunk: AttentionChunk, scaling: float) -> torch.Tensor:
    """Attention output `[chunk tokens, H, D]` for the chunk's new queries `q`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    n, queries = chunk.num_requests, chunk.max_extend_len
    keys = _gather(k_buffer, chunk.kv_indices, q.dtype).transpose(1, 2)  # [n, Hkv, max_seq, D]
    values = _gather(v_buffer, chunk.kv_indices, q.dtype).transpose(1, 2)
    if chunk.query_slots is None:
        grid = q
    else:
        grid = q.new_zeros(n * queries, num_heads, head_dim)
        grid[chunk.query_slots] = q
    grouped = _group_queries(grid.view(n, queries, num_heads, head_dim), num_kv_heads)
    out = F.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=chunk.grouped_mask(num_heads // num_kv_heads), scale=scaling
    )  # [n, Hkv, Q * G, D]
    out = _ungroup_queries(out, queries).reshape(n * queries, num_heads, head_dim)
    return out if chunk.query_slots is None else out[chunk.query_slots]


def _group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, Q, H, D]` -> `[B, Hkv, Q * G, D]`: the G query heads sharing a KV head become extra query rows
    (row `j * G + g`), so attention runs once per KV head without repeating K and V G times."""
    b, queries, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    grouped = q.view(b, queries, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    return grouped.reshape(b, num_kv_heads, queries * group, head_dim)


def _ungroup_queries(out: torch.Tensor, queries: int) -> torch.Tensor:
    """Inverse of `_group_queries`: `[B, Hkv, Q * G, D]` -> `[B, Q, H, D]` (H = Hkv * G)."""
    b, num_kv_heads, rows, head_dim = out.shape
    group = rows // queries
    ungrouped = out.view(b, num_kv_heads, queries, group, head_dim).permute(0, 2, 1, 3, 4)
    return ungrouped.reshape(b, queries, num_kv_heads * group, head_dim)


def _gather(buffer: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`buffer[slots]` as `[*slots.shape, Hkv, D]`; index_select is several times faster than advanced
    indexing on CPU for these row sizes."""
    rows = buffer.index_select(0, slots.reshape(-1)).view(*slots.shape, *buffer.shape[1:])
    return rows.to(dtype)
