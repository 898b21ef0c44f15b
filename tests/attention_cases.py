"""Random paged-attention batches built with the real KV pools, and a float64 reference to check them.

Shared by the attention backend tests and `benchmarks/gpu_check.py`. A case allocates its KV slots the way
the scheduler does (every request's cached prefix first, then all new tokens in one `alloc_extend`), from
a free list shuffled page by page, so requests' slots are scattered and interleaved. Every KV buffer starts
as random noise, so a kernel that reads a wrong slot (or the wrong layer) gives a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.radix_cache.swa_pool import SWAKVPool


@dataclass
class AttentionCase:
    batch: ForwardBatch
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], the new tokens' queries
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], the new tokens' keys (not yet in the pool)
    v: torch.Tensor
    prefix_k: list[torch.Tensor]  # per request: [prefix_len, num_kv_heads, head_dim] float64 on CPU
    prefix_v: list[torch.Tensor]
    layer_id: int
    scaling: float


def _shuffle_free_pages(allocator: KVAllocator, generator: torch.Generator) -> None:
    slots = allocator.alloc(allocator.size)
    assert slots is not None
    pages = slots.view(-1, allocator.page_size)
    pages = pages[torch.randperm(pages.shape[0], generator=generator)]
    if allocator.page_size == 1:
        allocator.free(pages.reshape(-1))  # freed in the order given
        return
    for page in pages:  # one free per page keeps the shuffled page order
        allocator.free(page)


def make_case(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_layers: int = 2,
    layer_id: int = 1,
    keep_reference_data: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> AttentionCase:
    """A batch whose request i has `prefix_lens[i]` positions already in the pool and `extend_lens[i]`
    new tokens (1 each for DECODE). `keep_reference_data=False` skips the host copies of the prefixes
    that `reference_attention` needs (for large timing batches). The pool holds `kv_dtype` (default: `dtype`,
    the queries' and new K/V's)."""
    assert len(prefix_lens) == len(extend_lens)
    if mode == ForwardMode.DECODE:
        assert all(e == 1 for e in extend_lens)
    gen = torch.Generator().manual_seed(seed)
    batch_size = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    # Room for every request plus a request's worth of partial pages, and some unused pages.
    capacity = (sum(seq_lens) + 2 * batch_size * page_size + 4 * page_size) // page_size * page_size

    req_pool = ReqToTokenPool(batch_size + 2, max(seq_lens) + 8, device=device)
    allocator = KVAllocator(capacity, page_size)
    kv_pool = TokenToKVPool(capacity, page_size, num_layers, num_kv_heads, head_dim, kv_dtype or dtype, device=device)
    noise = torch.Generator(device=device).manual_seed(seed)
    for layer in range(num_layers):
        for buffer in (kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]):
            buffer.copy_(torch.randn(buffer.shape, generator=noise, device=device))
    _shuffle_free_pages(allocator, gen)

    rows = [req_pool.alloc() for _ in range(batch_size)]
    prefix_k, prefix_v, last_slots = [], [], []
    k_layer, v_layer = kv_pool.get_kv_buffer(layer_id)
    for row, prefix_len in zip(rows, prefix_lens):
        if prefix_len == 0:
            if keep_reference_data:
                prefix_k.append(torch.zeros(0, num_kv_heads, head_dim, dtype=torch.float64))
                prefix_v.append(torch.zeros(0, num_kv_heads, head_dim, dtype=torch.float64))
            last_slots.append(-1)
            continue
        slots = allocator.alloc_extend([-1], [prefix_len]).to(device)
        req_pool.req_to_token[row, :prefix_len] = slots.to(torch.int32)
        if keep_reference_data:
            prefix_k.append(k_layer[slots].double().cpu())
            prefix_v.append(v_layer[slots].double().cpu())
        last_slots.append(int(slots[-1]))
    out_cache_loc = allocator.alloc_extend(last_slots, list(extend_lens)).to(device)
    start = 0
    positions = []
    for row, prefix_len, extend_len in zip(rows, prefix_lens, extend_lens):
        req_pool.req_to_token[row, prefix_len:prefix_len + extend_len] = out_cache_loc[start:start + extend_len].to(
            torch.int32
        )
        positions.append(torch.arange(prefix_len, prefix_len + extend_len))
        start += extend_len

    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)

    def as_tensor(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=out_cache_loc.to(torch.int64),
        req_pool_indices=as_tensor(rows),
        seq_lens=as_tensor(seq_lens),
        prefix_lens=as_tensor(prefix_lens),
        extend_lens=as_tensor(extend_lens),
        seq_lens_cpu=list(seq_lens),
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    return AttentionCase(batch, q, k, v, prefix_k, prefix_v, layer_id, head_dim ** -0.5)


def share_prefixes(case: AttentionCase, group_size: int, shared_len: int) -> AttentionCase:
    """Makes each run of `group_size` consecutive requests hold the KV slots of their first member's first
    `shared_len` positions (a cached prefix they share, as the radix cache hands out), in place; every request's
    prefix must be at least that long. The reference copies follow."""
    batch = case.batch
    assert all(length >= shared_len for length in batch.prefix_lens_cpu)
    req_to_token = batch.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices.tolist()
    for first in range(0, len(rows), group_size):
        for row in rows[first + 1:first + group_size]:
            req_to_token[row, :shared_len] = req_to_token[rows[first], :shared_len]
    if case.prefix_k:
        k_layer, v_layer = batch.token_to_kv_pool.get_kv_buffer(case.layer_id)
        for i, (row, prefix_len) in enumerate(zip(rows, batch.prefix_lens_cpu)):
            slots = req_to_token[row, :prefix_len].long()
            case.prefix_k[i] = k_layer[slots].double().cpu()
            case.prefix_v[i] = v_layer[slots].double().cpu()
    return case


def reference_attention(case: AttentionCase, device: str | torch.device = "cpu",
                        sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every new token over its request's prefix + new tokens, in float64 on `device`
    from the case's own copies of the data (it never reads the pool). Query head h uses KV head
    h // (num_heads // num_kv_heads). With a `sliding_window` W, the query at position t sees the keys at
    positions t - W < p <= t only. With `sinks` ([num_heads]), head h's softmax runs over its scores and one more
    logit `sinks[h]` whose value is zero (gpt-oss's attention sinks), as Hugging Face's eager gpt-oss attention."""
    batch = case.batch
    kv_dtype = batch.token_to_kv_pool.dtype
    q = case.q.to(device, torch.float64)
    k_new = case.k.to(kv_dtype).to(device, torch.float64)
    v_new = case.v.to(kv_dtype).to(device, torch.float64)
    group = q.shape[1] // k_new.shape[1]
    outputs = []
    start = 0
    for i, (prefix_len, extend_len) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        prefix_k = case.prefix_k[i].to(device)
        prefix_v = case.prefix_v[i].to(device)
        keys = torch.cat([prefix_k, k_new[start:start + extend_len]]).repeat_interleave(group, dim=1)
        values = torch.cat([prefix_v, v_new[start:start + extend_len]]).repeat_interleave(group, dim=1)
        queries = q[start:start + extend_len]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * case.scaling
        query_pos = prefix_len + torch.arange(extend_len, device=device)
        key_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
        visible = key_pos <= query_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > query_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink_column = sinks.to(device, torch.float64)[:, None, None].expand(-1, extend_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += extend_len
    return torch.cat(outputs)


def run_backend(backend, case: AttentionCase, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plan the case's batch on `backend` and run one layer (with `sliding_window` and `sinks`, if given); returns the
    output."""
    backend.plan(case.batch)
    if sinks is None:
        return backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch, sliding_window)
    return backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch, sliding_window, sinks)


def poison_outside_windows(case: AttentionCase, window: int) -> None:
    """Point every whole page of positions that no query of its request sees under `window` at a slot full of NaN
    (a freed page reused by another request may hold anything): a backend that reads one returns NaN. The slot is
    one no request holds."""
    batch = case.batch
    pool = batch.token_to_kv_pool
    req_to_token = batch.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices.tolist()
    held = {int(slot) for row, seq_len in zip(rows, batch.seq_lens_cpu) for slot in req_to_token[row, :seq_len]}
    poison = max(set(range(pool.page_size, pool.k_buffer[0].shape[0])) - held)
    for layer in range(len(pool.k_buffer)):
        pool.k_buffer[layer][poison] = float("nan")
        pool.v_buffer[layer][poison] = float("nan")
    for row, prefix_len in zip(rows, batch.prefix_lens_cpu):
        unseen = max(0, prefix_len - window + 1) // pool.page_size * pool.page_size
        req_to_token[row, :unseen] = poison


def kv_written(case: AttentionCase) -> bool:
    """Whether the new tokens' K/V now sit at `out_cache_loc` of the case's layer (at their window slots, for a
    window layer with a slot space of its own)."""
    k_layer, v_layer = case.batch.token_to_kv_pool.get_kv_buffer(case.layer_id)
    loc = case.batch.kv_write_loc(case.layer_id)
    dtype = k_layer.dtype  # compared as float32: torch has no equality for float8
    return bool(torch.equal(k_layer[loc].float(), case.k.to(dtype).float())
                and torch.equal(v_layer[loc].float(), case.v.to(dtype).float()))


def with_window_slots(case: AttentionCase, window: int, seed: int = 0) -> AttentionCase:
    """The case moved, in place, onto a pool whose layer `case.layer_id` keeps its KV in a window slot space of its own
    (radix_cache/swa_pool.py), as a sliding-window model's window layers do: the positions some query of their request
    sees under `window` get scattered window slots, every older position none (0, the dummy slot: its window KV was
    freed). The window buffers hold NaN in every slot no position maps to, so a backend that reads a window slot it
    should not, or the full buffer for that layer, returns NaN or a wrong answer. Page size 1."""
    batch = case.batch
    pool = batch.token_to_kv_pool
    assert pool.page_size == 1, "window slots are token-granular"
    req_to_token = batch.req_to_token_pool.req_to_token
    needed = torch.cat([req_to_token[row, max(0, prefix_len - window + 1):seq_len].long()
                        for row, prefix_len, seq_len in zip(batch.req_pool_indices.tolist(), batch.prefix_lens_cpu,
                                                            batch.seq_lens_cpu)])
    window_size = needed.numel() + 16
    generator = torch.Generator().manual_seed(seed)
    window_slots = (torch.randperm(window_size, generator=generator)[:needed.numel()] + 1).to(pool.device)
    full_to_window = torch.zeros(pool.size + 1, dtype=torch.int64, device=pool.device)
    full_to_window[needed.to(pool.device)] = window_slots
    layer_windows = [window if layer == case.layer_id else None for layer in range(pool.num_layers)]
    swa = SWAKVPool(pool.size, window_size, layer_windows, pool.num_kv_heads, pool.head_dim, pool.dtype,
                    full_to_window, pool.device)
    for layer in range(pool.num_layers):
        for full, own in ((pool.k_buffer, swa.k_buffer), (pool.v_buffer, swa.v_buffer)):
            if not swa.is_window_layer(layer):
                own[layer] = full[layer]
                continue
            own[layer].fill_(float("nan"))
            own[layer][0] = full[layer][0]  # padded key columns read the dummy slot (masked out): keep it finite
            own[layer][window_slots] = full[layer][needed.to(pool.device)]
    batch.token_to_kv_pool = swa
    batch.window_cache_loc = batch.window_write_slots()
    return case
