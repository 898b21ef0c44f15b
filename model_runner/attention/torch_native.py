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
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from radixserve.model_runner.attention.base import AttentionBackend, apply_sinks
from radixserve.model_runner.forward_batch import ForwardBatch

# Chunk limits per device type: (max padded (query, key) pairs per chunk, max padding waste). CPU values
# measured with SmolLM2-135M head shapes (9 query heads, 3 KV heads, head_dim 64). On a GPU every call
# costs launches rather than cache misses, so chunks are as large as memory for the mask comfortably allows
# (one padded call: about 2x faster than per-request calls for 32 decodes of 1k tokens on an H200).
CHUNK_LIMITS = {"cpu": (2048, 2.0), "cuda": (1 << 24, 4.0)}
# Shortest shared prefix attended once per group, per device type (inf: never). Below it, the extra call
# and the merge cost more than the gathers they save.
MIN_SHARED_PREFIX = {"cpu": 32, "cuda": math.inf}


@dataclass
class AttentionChunk:
    """Consecutive requests attended in one call. Their new tokens are `[token_start, token_end)` of the
    batch (tokens are concatenated in request order)."""

    token_start: int
    token_end: int
    num_requests: int
    max_extend_len: int
    kv_indices: torch.Tensor  # [requests, max_keys] int64 KV slots; padding -> slot 0
    mask: torch.Tensor  # [requests, 1, max_extend_len, max_keys] bool, True = attend
    # Row of each new token in the [requests * max_extend_len] query grid; None when no padding is needed.
    query_slots: Optional[torch.Tensor]
    _masks: dict = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The mask with each query row repeated `group` times (see `_group_queries`), built once; boolean,
        or additive (0 / -inf) in `dtype`."""
        key = (group, dtype)
        if key not in self._masks:
            # One mask row broadcasts over the group's query rows when each request has one query.
            mask = self.mask if self.max_extend_len == 1 else self.mask.repeat_interleave(group, dim=2)
            if dtype is not None:
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
            self._masks[key] = mask
        return self._masks[key]


@dataclass
class SharedPrefix:
    """Requests whose first `kv_indices.numel()` KV slots are the same, all before any of their queries."""

    token_index: torch.Tensor  # [tokens] int64: the members' new tokens, as positions in the batch
    kv_indices: torch.Tensor  # [length] int64: the shared KV slots
    # The first slot when the slots are consecutive (the usual case: a prefix prefilled in one piece from a
    # sorted free list), so the prefix's K/V is a view of the pool instead of a gathered copy.
    first_slot: Optional[int] = None
    members: tuple[int, ...] = ()  # the requests of the group, as batch indices


@dataclass
class TorchNativeMetadata:
    chunks: list[AttentionChunk]
    shared: list[SharedPrefix] = field(default_factory=list)
    shared_token_index: Optional[torch.Tensor] = None  # the groups' token_index, concatenated
    windowed: dict[int, "TorchNativeMetadata"] = field(default_factory=dict)  # window -> its plan, made at first use


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


def find_shared_prefixes(batch: ForwardBatch, min_len: int) -> tuple[list[SharedPrefix], list[int]]:
    """Groups of at least two requests sharing the KV slots of a cached prefix of `min_len` or more tokens,
    and per request the first key position its chunk still attends (the group's shared length, or 0)."""
    prefix_lens = batch.prefix_lens_cpu
    key_starts = [0] * batch.batch_size
    candidates = [i for i, length in enumerate(prefix_lens) if length >= min_len]
    if len(candidates) < 2:
        return [], key_starts
    device = batch.req_pool_indices.device
    pool_rows = batch.req_pool_indices[torch.tensor(candidates, device=device)]
    rows = batch.req_to_token_pool.req_to_token[pool_rows, :max(prefix_lens[i] for i in candidates)].to(torch.int64)
    by_first_slot = defaultdict(list)
    for position, slot in enumerate(rows[:, 0].tolist()):
        by_first_slot[slot].append(position)
    token_starts = [0]
    for extend_len in batch.extend_lens_cpu:
        token_starts.append(token_starts[-1] + extend_len)
    groups = []
    for positions in by_first_slot.values():
        if len(positions) < 2:
            continue
        members = [candidates[p] for p in positions]
        block = rows[positions, :min(prefix_lens[m] for m in members)]
        differs = (block != block[:1]).any(dim=0)
        length = int(differs.to(torch.int8).argmax()) if bool(differs.any()) else block.shape[1]
        if length < min_len:
            continue
        tokens = [t for m in members for t in range(token_starts[m], token_starts[m + 1])]
        slots = block[0, :length]
        first, last = slots[[0, -1]].tolist()
        consecutive = last - first == length - 1 and bool((slots[1:] - slots[:-1] == 1).all())
        groups.append(SharedPrefix(torch.tensor(tokens, dtype=torch.int64, device=device), slots,
                                   first if consecutive else None, tuple(members)))
        for m in members:
            key_starts[m] = length
    return groups, key_starts


@dataclass
class _QueryBlocks:
    """A batch's requests cut into blocks of consecutive new tokens, each planned as a request of its own (its
    "prefix" the positions before the block): the attributes of ForwardBatch that planning reads."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: object
    causal: bool = True


def _window_blocks(batch: ForwardBatch, window: int) -> "ForwardBatch | _QueryBlocks":
    """`batch` with every extend longer than `window` cut into blocks of `window` queries, so a block attends to at
    most 2 * window keys instead of its request's whole sequence; `batch` itself when no extend is that long."""
    if max(batch.extend_lens_cpu) <= window:
        return batch
    rows, prefixes, extends = [], [], []
    for i, (prefix, extend) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        for start in range(0, extend, window):
            rows.append(i)
            prefixes.append(prefix + start)
            extends.append(min(window, extend - start))
    device = batch.req_pool_indices.device
    seqs = [p + e for p, e in zip(prefixes, extends)]
    return _QueryBlocks(batch.req_pool_indices[torch.tensor(rows, device=device)],
                        torch.tensor(seqs, dtype=torch.int64, device=device),
                        torch.tensor(prefixes, dtype=torch.int64, device=device), seqs, prefixes, extends,
                        batch.req_to_token_pool, batch.causal)


def _plan_chunk(batch: ForwardBatch, first: int, last: int, token_start: int, key_starts: list[int],
                window: Optional[int] = None) -> AttentionChunk:
    device = batch.req_pool_indices.device
    extend_lens = batch.extend_lens_cpu[first:last]
    seq_lens = batch.seq_lens[first:last]
    max_ext = max(extend_lens)
    max_keys = max(seq - start for seq, start in zip(batch.seq_lens_cpu[first:last], key_starts))
    req_to_token = batch.req_to_token_pool.req_to_token
    offsets = torch.arange(max_keys, device=device)
    if any(key_starts):
        starts = torch.tensor(key_starts, dtype=torch.int64, device=device)
        key_pos = starts[:, None] + offsets[None, :]  # [n, max_keys]
        columns = key_pos.clamp(max=req_to_token.shape[1] - 1)
        rows = req_to_token[batch.req_pool_indices[first:last, None], columns].to(torch.int64)
    else:
        key_pos = offsets[None, :]
        rows = req_to_token[batch.req_pool_indices[first:last], :max_keys].to(torch.int64)
    in_seq = key_pos < seq_lens[:, None]
    kv_indices = torch.where(in_seq, rows, torch.zeros_like(rows))
    query_pos = batch.prefix_lens[first:last, None] + torch.arange(max_ext, device=device)[None, :]
    causal = key_pos[:, None, :] <= query_pos[:, :, None]  # [n, max_ext, max_keys]
    if not batch.causal:  # an encoder: every query sees its whole sequence
        causal = torch.ones_like(causal)
    if window is not None:  # padded query rows take their request's last position, so no row is empty
        last_pos = torch.minimum(query_pos, seq_lens[:, None] - 1)
        causal &= key_pos[:, None, :] > last_pos[:, :, None] - window
    mask = (causal & in_seq[:, None, :])[:, None]
    query_slots = None
    if any(e != max_ext for e in extend_lens):
        slots = [r * max_ext + j for r, e in enumerate(extend_lens) for j in range(e)]
        query_slots = torch.tensor(slots, dtype=torch.int64, device=device)
    return AttentionChunk(
        token_start, token_start + sum(extend_lens), last - first, max_ext, kv_indices, mask, query_slots
    )


def _attend_chunk(q, k_buffer, v_buffer, chunk: AttentionChunk, scaling: float, with_lse: bool):
    """Attention output `[chunk tokens, H, D]` for the chunk's new queries `q`, and with `with_lse` the
    log-sum-exp of each row's scores `[chunk tokens, H]` (float32), else None."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    n, queries = chunk.num_requests, chunk.max_extend_len
    keys = _gather(k_buffer, chunk.kv_indices, q.dtype).transpose(1, 2)  # [n, Hkv, max_keys, D]
    values = _gather(v_buffer, chunk.kv_indices, q.dtype).transpose(1, 2)
    if chunk.query_slots is None:
        grid = q
    else:
        grid = q.new_zeros(n * queries, num_heads, head_dim)
        grid[chunk.query_slots] = q
    grouped = _group_queries(grid.view(n, queries, num_heads, head_dim), num_kv_heads)
    group = num_heads // num_kv_heads
    if q.device.type == "cpu":  # an additive mask, built once per chunk, spares a conversion per call
        out, lse = _sdpa(grouped, keys, values, chunk.grouped_mask(group, q.dtype), scaling, with_lse)
    else:
        out, lse = _sdpa(grouped, keys, values, chunk.grouped_mask(group), scaling, with_lse)
    out = _ungroup_queries(out, queries).reshape(n * queries, num_heads, head_dim)  # from [n, Hkv, Q * G, D]
    if lse is not None:
        lse = _ungroup_queries(lse.unsqueeze(-1), queries).reshape(n * queries, num_heads)
    if chunk.query_slots is not None:
        out = out[chunk.query_slots]
        lse = None if lse is None else lse[chunk.query_slots]
    return out, lse


def _attend_shared(q, k_buffer, v_buffer, group: SharedPrefix, scaling: float):
    """All of a group's new queries `q [T, H, D]` against its shared prefix (no mask: every shared key
    precedes every query): output `[T, H, D]` and log-sum-exp `[T, H]`."""
    tokens, num_heads, head_dim = q.shape
    if group.first_slot is not None:
        rows = slice(group.first_slot, group.first_slot + group.kv_indices.numel())
        keys, values = k_buffer[rows].to(q.dtype), v_buffer[rows].to(q.dtype)
    else:
        keys, values = _gather(k_buffer, group.kv_indices, q.dtype), _gather(v_buffer, group.kv_indices, q.dtype)
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    grouped = _group_queries(q.view(1, tokens, num_heads, head_dim), keys.shape[1])
    out, lse = _sdpa(grouped, keys, values, None, scaling, with_lse=True)
    out = _ungroup_queries(out, tokens).reshape(tokens, num_heads, head_dim)
    return out, _ungroup_queries(lse.unsqueeze(-1), tokens).reshape(tokens, num_heads)


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's output `[T, H, D]` and log-sum-exp
    `[T, H]`: the outputs weighted by their share of the total softmax mass."""
    compute = torch.promote_types(out_a.dtype, torch.float32)
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    merged = (out_a.to(compute) * (weight_a / total).unsqueeze(-1)
              + out_b.to(compute) * (weight_b / total).unsqueeze(-1))
    return merged.to(out_a.dtype)


def _sdpa(q, k, v, mask, scale: float, with_lse: bool):
    """Scaled-dot-product attention `[B, Hkv, rows, D]`; returns `(out, lse [B, Hkv, rows] float32 or None)`.
    `mask` is None, or additive in q's dtype on the CPU (its flash kernel takes no other), boolean (True =
    attend) elsewhere."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, (lse if with_lse else None)
    if not with_lse:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), None
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


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
