"""The torch_native backend's attention arithmetic over a plan (torch_native_plan.py): K/V gathered through a chunk's
slot table, the query heads sharing a KV head folded into query rows, scaled-dot-product attention with its
log-sum-exp, and the merge of two partial results over disjoint key sets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from radixserve.model_runner.attention.torch_native_plan import AttentionChunk, SharedPrefix


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
