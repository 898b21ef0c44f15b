"""Paged attention in plain PyTorch: the reference backend, for CPU and GPU.

Per batch, `plan` splits the requests into chunks of consecutive requests and, per chunk, gathers the KV slot
indices `req_to_token[row, start:seq_len]` into a padded `[requests, max_keys]` table and builds the causal
mask. Per layer, `forward` writes the new tokens' K/V into the pool, then for each chunk gathers the K/V
through that table and runs scaled-dot-product attention once per KV head: the query heads sharing a KV
head are folded into the query-row dimension, so K and V are never repeated for grouped-query attention.

Why chunks: one padded batch over all requests costs one call per layer but pads every request to the
longest one and gathers one large K/V copy that falls out of the CPU caches (measured 3x slower than a
loop over requests at 64 requests x 1000 tokens); one call per request wastes nothing but pays Python and
dispatch overhead per request and layer (2-7x slower than one padded call for 8-128 short decodes). A
chunk grows while its padded (query, key) pairs stay under `max_chunk_pairs` (which also bounds its
gathered K/V rows) and under `max_padding_waste` times its real pairs. On CPU, decode batches form chunks
of a few thousand KV rows, short prompts are batched and long prompts run one by one; on a GPU a batch is
usually one chunk. EXTEND, DECODE and MIXED batches all take this one path.

Shared prefixes (cascade attention): requests that extend the same cached prefix hold the same KV slots
for it, because the radix cache hands them the same pages. `plan` finds such groups (same first slot, then
the longest run of equal slots, never past a member's own prefix length, so every key of the shared part
precedes every query of the group). `forward` then attends all the group's new tokens to the shared keys
in one call, which reads the prefix's K/V once per group instead of gathering a copy per request; the
chunks cover only each request's keys after the shared part (`start` above); the two partial results
are merged by their log-sum-exp. Softmax over a split key set is exact, so this changes only the float
rounding. It pays off on the CPU, where the gathers dominate decode; on a GPU it is off by default.

Sliding windows: a layer called with a window W attends from position t only to keys in (t - W, t]. Its plan (made
at the batch's first such layer, kept for the others) cuts each request's new tokens into blocks of at most W
queries, starts each block's keys at the window of its first query, so no older slot is gathered and a long prefill
attends to O(W) keys a query, masks the rest per query, and shares no prefix. A
batch whose sequences all fit in W runs the full layers' plan.

Causality: new token j of request i sits at position `prefix_lens[i] + j` and attends to key positions
`<= prefix_lens[i] + j`; in a batch with `causal=False` (an encoder's) it attends to every key of its sequence. Padded key columns point at slot 0 (the pool's dummy page) and are masked out;
padded query rows see the whole sequence (so no row is empty) and their output is dropped.

This module holds the backend and its limits; the plan's types and builders are in torch_native_plan.py, the
attention arithmetic (gather, grouped-query folding, SDPA with log-sum-exp, the merge) in torch_native_sdpa.py.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixserve.model_runner.attention.base import AttentionBackend, apply_sinks
from radixserve.model_runner.attention.torch_native_plan import (AttentionChunk, TorchNativeMetadata, _plan_chunk,
                                                                 _window_blocks, find_shared_prefixes)
from radixserve.model_runner.attention.torch_native_sdpa import (_attend_chunk, _attend_shared,
                                                                 merge_partial_attention)
from radixserve.model_runner.forward_batch import ForwardBatch

# Chunk limits per device type: (max padded (query, key) pairs per chunk, max padding waste). CPU values
# measured with SmolLM2-135M head shapes (9 query heads, 3 KV heads, head_dim 64). On a GPU every call
# costs launches rather than cache misses, so chunks are as large as memory for the mask comfortably allows
# (one padded call: about 2x faster than per-request calls for 32 decodes of 1k tokens on an H200).
CHUNK_LIMITS = {"cpu": (2048, 2.0), "cuda": (1 << 24, 4.0)}
# Shortest shared prefix attended once per group, per device type (inf: never). Below it, the extra call
# and the merge cost more than the gathers they save.
MIN_SHARED_PREFIX = {"cpu": 32, "cuda": math.inf}


class TorchNativeAttention(AttentionBackend):
    """Reference attention backend; correct for EXTEND, DECODE and MIXED batches of any lengths.

    Limits left as None take `CHUNK_LIMITS` and `MIN_SHARED_PREFIX` of the batch's device type.
    `max_chunk_pairs=0` runs request by request; both chunk limits at infinity run one padded batch.
    `min_shared_prefix=math.inf` turns cascade attention off; 1 uses it for any shared prefix.
    """

    def __init__(
        self,
        max_chunk_pairs: Optional[float] = None,
        max_padding_waste: Optional[float] = None,
        min_shared_prefix: Optional[float] = None,
    ) -> None:
        self.max_chunk_pairs = max_chunk_pairs
        self.max_padding_waste = max_padding_waste
        self.min_shared_prefix = min_shared_prefix
        self.num_cascade_batches = 0  # batches planned with at least one shared-prefix group

    # ---- planning --------------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        device_type = batch.req_pool_indices.device.type
        min_shared = self.min_shared_prefix
        if min_shared is None:
            min_shared = MIN_SHARED_PREFIX.get(device_type, math.inf)
        shared, key_starts = [], [0] * batch.batch_size
        if batch.batch_size > 1 and min_shared != math.inf:
            shared, key_starts = find_shared_prefixes(batch, max(1, int(min_shared)))
        chunks = self._plan_chunks(batch, key_starts, None)
        shared_index = None
        if shared:
            shared_index = torch.cat([group.token_index for group in shared])
            self.num_cascade_batches += 1
        batch.attn_metadata = TorchNativeMetadata(chunks, shared, shared_index)

    def _plan_chunks(self, batch: ForwardBatch, key_starts: list[int], window: Optional[int]) -> list[AttentionChunk]:
        key_lens = [seq - start for seq, start in zip(batch.seq_lens_cpu, key_starts)]
        chunks = []
        token_start = 0
        for first, last in self.split_requests(batch.extend_lens_cpu, key_lens, batch.req_pool_indices.device.type):
            chunk = _plan_chunk(batch, first, last, token_start, key_starts[first:last], window)
            chunks.append(chunk)
            token_start = chunk.token_end
        return chunks

    def metadata_for(self, batch: ForwardBatch, sliding_window: Optional[int]) -> TorchNativeMetadata:
        """The plan a layer with `sliding_window` runs on (see the module docstring): the batch's own plan for a
        full layer, or for a window that every sequence of the batch fits in (unless the window layers have slots of
        their own, radix_cache/swa_pool.py)."""
        meta: TorchNativeMetadata = batch.attn_metadata
        if sliding_window is None:
            return meta
        if max(batch.seq_lens_cpu) <= sliding_window and batch.token_to_kv_pool.window_map is None:
            return meta
        if sliding_window not in meta.windowed:
            meta.windowed[sliding_window] = self.plan_window(batch, sliding_window)
        return meta.windowed[sliding_window]

    def plan_window(self, batch: ForwardBatch, window: int) -> TorchNativeMetadata:
        """The plan of `batch` for layers with a sliding `window`: each request's new tokens in blocks of at most
        `window` queries, each block's keys from its first query's window on, no shared prefixes. A pool whose window
        layers have slots of their own gets the chunks' key slots in that space."""
        blocks = _window_blocks(batch, window)
        key_starts = [max(0, prefix - window + 1) for prefix in blocks.prefix_lens_cpu]
        chunks = self._plan_chunks(blocks, key_starts, window)
        window_map = batch.token_to_kv_pool.window_map
        if window_map is not None:
            for chunk in chunks:  # padding stays at slot 0, the window space's dummy slot too
                chunk.kv_indices = window_map[chunk.kv_indices]
        return TorchNativeMetadata(chunks)

    def split_requests(
        self, extend_lens: list[int], key_lens: list[int], device_type: str = "cpu"
    ) -> list[tuple[int, int]]:
        """Request ranges `[first, last)` of the chunks, grown greedily in batch order; request i attends
        `extend_lens[i]` queries to `key_lens[i]` keys."""
        default_pairs, default_waste = CHUNK_LIMITS.get(device_type, CHUNK_LIMITS["cuda"])
        max_pairs = default_pairs if self.max_chunk_pairs is None else self.max_chunk_pairs
        max_waste = default_waste if self.max_padding_waste is None else self.max_padding_waste
        ranges = []
        first, num_requests = 0, len(key_lens)
        while first < num_requests:
            last = first + 1
            max_ext, max_keys, real_work = extend_lens[first], key_lens[first], extend_lens[first] * key_lens[first]
            while last < num_requests:
                ext, keys = max(max_ext, extend_lens[last]), max(max_keys, key_lens[last])
                work = real_work + extend_lens[last] * key_lens[last]
                padded_pairs = (last + 1 - first) * ext * keys
                if padded_pairs > max_pairs or padded_pairs > max_waste * work:
                    break
                max_ext, max_keys, real_work = ext, keys, work
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
        sliding_window: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self.run(self.metadata_for(batch, sliding_window), q, k, v, layer_id, scaling, batch, sinks)

    def run(self, meta: TorchNativeMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
            scaling: float, batch: ForwardBatch, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`forward` on the plan `meta` of `batch`."""
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, batch.kv_write_loc(layer_id), k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        with_lse = bool(meta.shared) or sinks is not None
        if len(meta.chunks) == 1:
            out, lse = _attend_chunk(q, k_buffer, v_buffer, meta.chunks[0], scaling, with_lse)
        else:
            out = torch.empty_like(q)
            lse = q.new_empty(q.shape[:2], dtype=torch.float32) if with_lse else None
            for chunk in meta.chunks:
                rows = slice(chunk.token_start, chunk.token_end)
                out[rows], chunk_lse = _attend_chunk(q[rows], k_buffer, v_buffer, chunk, scaling, with_lse)
                if with_lse:
                    lse[rows] = chunk_lse
        if not with_lse:
            return out
        if meta.shared:
            out, lse = self._add_shared_prefixes(meta, q, k_buffer, v_buffer, scaling, out, lse)
        return out if sinks is None else apply_sinks(out, lse, sinks)

    @staticmethod
    def _add_shared_prefixes(meta: TorchNativeMetadata, q, k_buffer, v_buffer, scaling: float, out: torch.Tensor,
                             lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' queries attended to their shared prefixes and merged into `out` (each row's keys after the
        shared part); returns the merged output and log-sum-exp over both key sets."""
        index = meta.shared_token_index
        prefix_out = q.new_empty((index.numel(), *q.shape[1:]))
        prefix_lse = q.new_empty((index.numel(), q.shape[1]), dtype=torch.float32)
        start = 0
        for group in meta.shared:
            rows = slice(start, start + group.token_index.numel())
            prefix_out[rows], prefix_lse[rows] = _attend_shared(q[group.token_index], k_buffer, v_buffer, group, scaling)
            start = rows.stop
        own_lse = lse[index]
        out[index] = merge_partial_attention(out[index], own_lse, prefix_out, prefix_lse)
        lse[index] = torch.logaddexp(own_lse, prefix_lse)
        return out, lse
