"""The torch_native backend's plan of a batch (torch_native.py's module docstring tells the whole design): the
chunks of consecutive requests with their padded KV slot tables and causal (or windowed) masks, the groups of
requests sharing a cached prefix, and a batch's extends cut into blocks for a sliding window.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardBatch


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
