"""Cascade attention in TorchNativeAttention: requests that share a cached prefix's KV slots attend it in one
call per group, and the merged result equals causal attention over each request's own keys (float64
reference). The batches are built the way the radix cache shares pages: a group's prefix slots are allocated
once and written into every member's `req_to_token` row; members may have private tokens after it.
"""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.attention.torch_native_sdpa import merge_partial_attention
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool

NUM_LAYERS = 2
LAYER = 1
HEAD_DIM = 8

# Per request: (group or None, private prefix tokens after the group's shared part, new tokens).
# Group lengths are multiples of both page sizes, as the radix cache shares whole pages.
GROUP_LENS = {"a": 12, "b": 8}
LAYOUTS = {
    ForwardMode.DECODE: [("a", 0, 1), ("b", 3, 1), ("a", 5, 1), (None, 9, 1), ("a", 0, 1), ("b", 0, 1)],
    ForwardMode.EXTEND: [("a", 0, 4), ("b", 2, 3), ("a", 5, 1), (None, 0, 6), ("a", 0, 2), ("b", 0, 7)],
    ForwardMode.MIXED: [("a", 0, 1), (None, 4, 5), ("a", 6, 1), ("b", 0, 3), ("b", 1, 1)],
}


def build(mode, page_size, num_heads, num_kv_heads, dtype, seed, split_prefixes=False, head_dim=HEAD_DIM,
          device="cpu"):
    """The batch of LAYOUTS[mode]; with `split_prefixes`, each group's prefix slots have a gap after the
    first 4 (so they are not consecutive and must be gathered)."""
    layout = LAYOUTS[mode]
    gen = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(size=len(layout) + 1, max_context_len=64, device=device)
    allocator = KVAllocator(size=512, page_size=page_size)
    kv_pool = TokenToKVPool(512, page_size, NUM_LAYERS, num_kv_heads, head_dim, dtype, device=device)
    for layer in range(NUM_LAYERS):
        for buffer in (kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]):
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
    scratch = allocator.alloc(6 * page_size)  # scatter the slots
    rows = [req_pool.alloc() for _ in layout]
    allocator.free(scratch[::2])

    owner = {}
    prefix_lens = []
    for row, (group, private, _) in zip(rows, layout):
        shared = 0
        if group is not None:
            shared = GROUP_LENS[group]
            if group not in owner:
                owner[group] = row
                head = 4 if split_prefixes else shared
                assign_kv_slots(allocator, req_pool, [row], [0], [head])
                if split_prefixes:
                    allocator.alloc(page_size)  # the gap
                    assign_kv_slots(allocator, req_pool, [row], [head], [shared - head])
            else:
                req_pool.req_to_token[row, :shared] = req_pool.req_to_token[owner[group], :shared]
        if private:
            assign_kv_slots(allocator, req_pool, [row], [shared], [private])
        prefix_lens.append(shared + private)
    extend_lens = [new for _, _, new in layout]
    out_cache_loc = assign_kv_slots(allocator, req_pool, rows, prefix_lens, extend_lens)
    batch = make_forward_batch(mode, rows, prefix_lens, [[0] * n for n in extend_lens], out_cache_loc,
                               req_pool, kv_pool)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return batch, q, k, v


def reference(batch, q, k, v, scaling):
    """Float64 causal attention of each request over the pool's K/V at its own row's slots."""
    k_buffer, v_buffer = (buffer.cpu() for buffer in batch.token_to_kv_pool.get_kv_buffer(LAYER))
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for row, prefix_len, extend_len in zip(batch.req_pool_indices.tolist(), batch.prefix_lens_cpu,
                                           batch.extend_lens_cpu):
        slots = batch.req_to_token_pool.req_to_token[row, :prefix_len].long().cpu()
        new = slice(start, start + extend_len)
        keys = torch.cat([k_buffer[slots].double(), k[new].double()]).repeat_interleave(group, dim=1)
        values = torch.cat([v_buffer[slots].double(), v[new].double()]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[new].double(), keys) * scaling
        query_pos = prefix_len + torch.arange(extend_len)
        visible = torch.arange(prefix_len + extend_len)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible[None], -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values))
        start += extend_len
    return torch.cat(out)


@pytest.mark.parametrize("mode", list(LAYOUTS))
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (3, 3), (6, 1)])
@pytest.mark.parametrize("split", [dict(max_chunk_pairs=0), dict(max_chunk_pairs=math.inf, max_padding_waste=math.inf)])
@pytest.mark.parametrize("split_prefixes", [False, True])
def test_cascade_matches_float64_reference(mode, page_size, num_heads, num_kv_heads, split, split_prefixes):
    batch, q, k, v = build(mode, page_size, num_heads, num_kv_heads, torch.float32, seed=page_size + num_heads,
                           split_prefixes=split_prefixes)
    backend = TorchNativeAttention(min_shared_prefix=1, **split)
    backend.plan(batch)
    groups = batch.attn_metadata.shared
    # Both groups are found, each with its whole shared length (request "b" with a private prefix included).
    assert sorted(group.kv_indices.numel() for group in groups) == sorted(GROUP_LENS.values())
    # Consecutive prefixes are read as views of the pool, split ones gathered.
    assert all((group.first_slot is None) == split_prefixes for group in groups)
    scaling = HEAD_DIM ** -0.5
    expected = reference(batch, q, k, v, scaling)
    out = backend.forward(q, k, v, LAYER, scaling, batch)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_cascade_in_bfloat16_agrees_with_plain_chunks():
    batch, q, k, v = build(ForwardMode.DECODE, 1, 6, 2, torch.bfloat16, seed=3)
    scaling = HEAD_DIM ** -0.5
    expected = reference(batch, q, k, v, scaling)
    cascade = TorchNativeAttention(min_shared_prefix=1)
    cascade.plan(batch)
    assert batch.attn_metadata.shared
    out = cascade.forward(q, k, v, LAYER, scaling, batch)
    assert out.dtype == torch.bfloat16
    plain = TorchNativeAttention(min_shared_prefix=math.inf)
    plain.plan(batch)
    assert not batch.attn_metadata.shared
    plain_out = plain.forward(q, k, v, LAYER, scaling, batch)
    # Cascade is as close to the float64 reference as the single-pass kernel is.
    cascade_err = (out.double() - expected).abs().max()
    plain_err = (plain_out.double() - expected).abs().max()
    assert cascade_err <= 2 * plain_err + 1e-3


def test_threshold_and_default():
    batch, *_ = build(ForwardMode.DECODE, 1, 4, 2, torch.float32, seed=0)
    TorchNativeAttention(min_shared_prefix=10).plan(batch)
    assert [g.kv_indices.numel() for g in batch.attn_metadata.shared] == [12]  # group "b" (8) is too short
    TorchNativeAttention().plan(batch)  # the CPU default needs 32 shared tokens
    assert batch.attn_metadata.shared == []


def test_merge_partial_attention_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 4, generator=gen, dtype=torch.float64)
    keys = torch.randn(9, 2, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(9, 2, 4, generator=gen, dtype=torch.float64)

    def attend(ks, vs):
        scores = torch.einsum("thd,khd->thk", q, ks)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.einsum("thk,khd->thd", torch.softmax(scores, dim=-1), vs), lse

    whole, _ = attend(keys, values)
    (out_a, lse_a), (out_b, lse_b) = attend(keys[:4], values[:4]), attend(keys[4:], values[4:])
    torch.testing.assert_close(merge_partial_attention(out_a, lse_a, out_b, lse_b), whole)
