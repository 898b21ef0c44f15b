"""Cascade attention for decode batches on FlashInfer: requests that hold the same KV slots for a cached prefix
read that prefix once per group instead of once per request.

A decode step reads every request's whole context. When many requests continue the same long prompt (a shared
system prompt, few-shot examples, n samples of one prompt), most of those reads are the same keys again. The
scheduler names such groups from the radix tree (`ForwardBatch.prefix_groups`, scheduler/prefix_groups.py), and
each layer then attends in two parts:

- shared: one non-causal paged prefill per group over its shared pages, whose queries are the members' (gathered
  into group order), so the shared keys pass through the GPU's memory once for all members;
- own: the batch's decode over each request's keys after its group's shared part (all keys for a request in no
  group);

and merges the two partial results by their log-sum-exps (FlashInfer's `merge_state`, one kernel).

Cascade plans change with every batch's groups, so they run outside CUDA graphs: a batch that fits a captured
graph runs eagerly only when the reads saved clearly outweigh the launches a graph saves (`prefers_eager`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from radixserve.kernels import flashinfer_wrappers as fi
from radixserve.kernels.kv_indices import PagedKVIndex, build_paged_kv_index
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.radix_cache.pool import TokenToKVPool

# Cached positions two requests must share to form a group: a short common header is not worth a second kernel.
MIN_SHARED_POSITIONS = 64
# KV bytes (all layers) a step must avoid reading for cascade to run: without a graph, its two extra small kernels
# per layer are paid for by ~0.1 ms of reads on an H200 ...
MIN_SAVED_BYTES = 512 << 20
# ... and instead of a captured graph, by reads worth more than the launches the graph saves (several ms for a
# 32-layer model; a graph replay of a small batch takes about as long as the launches alone).
MIN_SAVED_BYTES_OVER_GRAPH = 32 << 30


@dataclass
class CascadeMetadata:
    shared_wrapper: Any  # planned non-causal prefill: group members' queries over their group's shared pages
    own_wrapper: Any  # planned decode: every request over its keys after the shared part
    shared_index: PagedKVIndex  # kept alive while the wrappers read their page ids
    own_index: PagedKVIndex
    member_rows: torch.Tensor  # [members] int64 on the device: batch rows of all groups' members, group by group


def saved_bytes(batch: ForwardBatch) -> int:
    """KV bytes per step (all layers) that cascade attention would not read for `batch`."""
    groups = batch.prefix_groups
    if groups is None:
        return 0
    pool = batch.token_to_kv_pool
    return groups.saved_positions() * TokenToKVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads,
                                                                     pool.head_dim, pool.dtype)


def cascade_pays(batch: ForwardBatch, min_saved_bytes: int) -> bool:
    return batch.mode == ForwardMode.DECODE and batch.prefix_groups is not None and (
        saved_bytes(batch) >= min_saved_bytes)


def plan_cascade(batch: ForwardBatch, shared_wrapper: Any, own_wrapper: Any, shape: tuple[int, int, int, int],
                 q_dtype: torch.dtype, sm_scale: float) -> Optional[CascadeMetadata]:
    """Plan both levels for a DECODE `batch` with prefix groups; `shape` is (heads, kv heads, head_dim, page
    size). None when the groups share nothing the pages can express."""
    groups = batch.prefix_groups
    assert groups is not None and batch.mode == ForwardMode.DECODE
    page_size = shape[3]
    req_to_token = batch.req_to_token_pool.req_to_token
    device = req_to_token.device
    lengths = [length - length % page_size for length in groups.lengths]
    kept = [(members, length) for members, length in zip(groups.members, lengths) if length > 0]
    if not kept:
        return None
    starts = [0] * batch.batch_size
    for members, length in kept:
        for row in members:
            starts[row] = length
    kv_dtype = batch.token_to_kv_pool.dtype
    own_index = build_paged_kv_index(req_to_token, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu,
                                     page_size, starts_host=starts)
    fi.plan_decode(own_wrapper, own_index, *shape, q_dtype, kv_dtype, sm_scale)

    member_rows = [row for members, _ in kept for row in members]
    # Host-to-device copies stay asynchronous: a blocking one would wait for the batch still running (overlap).
    first_members = torch.tensor([members[0] for members, _ in kept], dtype=torch.int64).to(device, non_blocking=True)
    shared_lengths = [length for _, length in kept]
    shared_index = build_paged_kv_index(req_to_token, batch.req_pool_indices[first_members],
                                        torch.tensor(shared_lengths).to(device, non_blocking=True), shared_lengths,
                                        page_size)
    qo_indptr = torch.zeros(len(kept) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor([len(members) for members, _ in kept], dtype=torch.int32), dim=0)
    fi.plan_prefill(shared_wrapper, qo_indptr, shared_index, *shape, q_dtype, kv_dtype, sm_scale, causal=False)
    return CascadeMetadata(shared_wrapper, own_wrapper, shared_index, own_index,
                           torch.tensor(member_rows, dtype=torch.int64).to(device, non_blocking=True))


def warm_up_cascade(shared_wrapper: Any, own_wrapper: Any, shape: tuple[int, int, int, int], q_dtype: torch.dtype,
                    kv_dtype: torch.dtype, sm_scale: float, device: torch.device) -> None:
    """One cascade step of one layer on two requests that share a page: its kernels (the paged prefill with
    log-sum-exps, `merge_state`) compile on their first use on a new machine, several seconds that would otherwise
    stall the first shared-prefix decode step of a running server."""
    num_heads, num_kv_heads, head_dim, page_size = shape
    # Request i holds the shared page 0 and then one position on page i + 1.
    req_to_token = torch.tensor([[*range(page_size), (i + 1) * page_size] for i in range(2)], dtype=torch.int32,
                                device=device)
    rows = torch.arange(2, dtype=torch.int64, device=device)
    lengths = [page_size + 1] * 2
    own_index = build_paged_kv_index(req_to_token, rows, torch.tensor(lengths, device=device), lengths, page_size,
                                     starts_host=[page_size] * 2)
    shared_index = build_paged_kv_index(req_to_token, rows[:1], torch.tensor([page_size], device=device),
                                        [page_size], page_size)
    fi.plan_decode(own_wrapper, own_index, *shape, q_dtype, kv_dtype, sm_scale)
    fi.plan_prefill(shared_wrapper, torch.tensor([0, 2], dtype=torch.int32), shared_index, *shape, q_dtype, kv_dtype,
                    sm_scale, causal=False)
    buffer = torch.zeros(3 * page_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
    q = torch.zeros(2, num_heads, head_dim, dtype=q_dtype, device=device)
    run_cascade(CascadeMetadata(shared_wrapper, own_wrapper, shared_index, own_index, rows), q, buffer, buffer,
                page_size)
    torch.cuda.synchronize(device)


def run_cascade(meta: CascadeMetadata, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                page_size: int, return_lse: bool = False) -> Any:
    """One layer: `q` `[batch, heads, head_dim]` (one query per request) -> attention output of the same shape, and
    with `return_lse` the base-2 log-sum-exp over both key sets `[batch, heads]`."""
    out, lse = fi.run_paged(meta.own_wrapper, q, k_buffer, v_buffer, page_size, return_lse=True)
    rows = meta.member_rows
    shared_out, shared_lse = fi.run_paged(meta.shared_wrapper, q.index_select(0, rows), k_buffer, v_buffer,
                                          page_size, return_lse=True)
    merged, merged_lse = fi.require_flashinfer().merge_state(out.index_select(0, rows), lse.index_select(0, rows),
                                                              shared_out, shared_lse)
    out = out.index_copy_(0, rows, merged)
    return (out, lse.index_copy_(0, rows, merged_lse)) if return_lse else out
