"""Paged attention on the CPU through the C++ kernel of `kernels/cpu_attention.cpp`: one call per layer.

`plan` describes the batch once as groups of requests (see the kernel's header): requests that hold the same KV
slots for a cached prefix (found as in torch_native's cascade attention) form a group whose shared keys are read
once for all its query rows; every other request is a group of its own. A group's members together hold at most
`max_group_tokens` new tokens (longer ones are split into several groups over the same shared keys), so an item's
working set stays in the core's caches. Each request's own keys are its KV slots after the shared part, listed
once per batch from `req_to_token`; the kernel reads K and V through them, with no gathered copy.

Work items are (group, block of `QUERY_BLOCK` queries of a lone request), every head at once, ordered longest
first so the threads' dynamic hand-out ends together. `forward` writes the new K/V into the pool and attends, in the kernel.

The pool holds the queries' dtype (float32 or bfloat16), or float16 under float32 queries (the default under a
GGUF's blocks, model_runner/model_runner.py): the kernel converts each tile of float16 keys and values to float32 once
and computes as on a float32 pool.

Until the kernel library is loaded (built at first use in the background, see `kernels/cpu_build.py`), every
batch, and batches of dtypes or head sizes it does not cover, go through the torch_native backend, the reference;
so do batches with an extend longer than `max_extend_len`, where one is given (none by default, see
`MAX_KERNEL_EXTEND_LEN`).

Sliding-window layers: in a batch of one query a request (decode), the kernel reads each request's last W keys (a
plan of their own, made at the batch's first windowed layer, no shared prefixes); a query block's keys would need a
per-row lower bound the kernel does not take, so windowed layers of extend batches run torch_native's window plan.

Attention sinks (gpt-oss): the kernel also writes each row's log-sum-exp, and the sink's share of the softmax is taken
out of the output after it (`base.apply_sinks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.base import AttentionBackend, apply_sinks
from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.attention.torch_native_plan import TorchNativeMetadata, find_shared_prefixes
from radixserve.model_runner.forward_batch import ForwardBatch

QUERY_BLOCK = 16  # query tokens per work item of a lone request
# Every extend runs here by default, long prefills included: on an AMX CPU the kernel ties torch_native's
# scaled-dot-product path on 512-token prefill chunks, and on an AVX-512-BF16 CPU without AMX it takes one layer's
# attention of a 4,096-token prefill from 346 to 110 ms in bfloat16 and from 344 to 157 ms in float32
# (benchmarks/cpu_kernels.py; torch_native masks every key, so its causal half is computed too). `max_extend_len`
# sends longer extends to torch_native.
MAX_KERNEL_EXTEND_LEN: Optional[int] = None
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the pool's; float16 under float32 queries only


@dataclass
class CpuAttentionPlan:
    items: torch.Tensor  # [n, 3] int64: (group, q_begin, q_end)
    group_member_indptr: torch.Tensor
    group_kv_indptr: torch.Tensor
    member_q_start: torch.Tensor
    member_q_len: torch.Tensor
    member_q_pos0: torch.Tensor
    member_kv_indptr: torch.Tensor
    member_kv_pos0: torch.Tensor
    kv_slots: torch.Tensor
    out_cache_loc: torch.Tensor
    num_groups_shared: int  # groups with shared keys and more than one member (reported by tests)
    # Sliding window -> the plan of its layers (a kernel plan for decode, torch_native's otherwise), made at first use.
    windowed: dict[int, "CpuAttentionPlan | TorchNativeMetadata"] = field(default_factory=dict)


class CpuAttentionBackend(AttentionBackend):
    """The CPU's fast attention; torch_native's results up to float rounding (tests/ops/test_cpu_attention.py). `amx`:
    bfloat16 scores on AMX tiles where the CPU has them (the runner's dispatch table, model_runner/cpu/dispatch.py;
    False: AVX-512 dot products). `row_invariant` (deterministic inference): every query row computed as a decode row
    is, so that its bits never depend on the rows beside it (see the kernel's `row_invariant`)."""

    def __init__(self, min_shared_prefix: int = 32, max_group_tokens: int = 64,
                 max_extend_len: Optional[int] = MAX_KERNEL_EXTEND_LEN, amx: bool = True,
                 row_invariant: bool = False) -> None:
        self.amx = amx
        self.row_invariant = row_invariant
        self.min_shared_prefix = min_shared_prefix
        self.max_group_tokens = max_group_tokens
        self.max_extend_len = max_extend_len
        self.fallback = TorchNativeAttention()
        self.kernel_cascade_batches = 0  # kernel batches with at least one shared-prefix group
        cpu_build.start_background_build()

    def plan(self, batch: ForwardBatch) -> None:
        pool = batch.token_to_kv_pool
        buffer = pool.k_buffer[0]
        long_extend = self.max_extend_len is not None and max(batch.extend_lens_cpu) > self.max_extend_len
        if long_extend or not cpu_build.ready() or buffer.dtype not in SUPPORTED_DTYPES or buffer.is_cuda or not all(
                supported_head_dim(head_dim) for _, head_dim in pool.layer_shapes):
            self.fallback.plan(batch)
            return
        batch.attn_metadata = plan_groups(batch, self.min_shared_prefix, self.max_group_tokens)
        self.kernel_cascade_batches += batch.attn_metadata.num_groups_shared > 0

    @property
    def num_cascade_batches(self) -> int:
        """Batches planned with at least one shared-prefix group, here or on the torch_native path."""
        return self.kernel_cascade_batches + self.fallback.num_cascade_batches

    def forward(self, q, k, v, layer_id: int, scaling: float, batch: ForwardBatch,
                sliding_window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        meta, pool = batch.attn_metadata, batch.token_to_kv_pool
        if not isinstance(meta, CpuAttentionPlan) or not kernel_dtypes(q.dtype, pool.k_buffer[0].dtype):
            if isinstance(meta, CpuAttentionPlan):  # a dtype the kernel was not planned for: re-plan the reference
                self.fallback.plan(batch)
            return self.fallback.forward(q, k, v, layer_id, scaling, batch, sliding_window, sinks)
        if sliding_window is not None and (max(batch.seq_lens_cpu) > sliding_window or pool.window_map is not None):
            if sliding_window not in meta.windowed:
                meta.windowed[sliding_window] = self._plan_window(batch, sliding_window)
            meta = meta.windowed[sliding_window]
            if isinstance(meta, TorchNativeMetadata):
                return self.fallback.run(meta, q, k, v, layer_id, scaling, batch, sinks)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        # With sinks the kernel also writes each row's log-sum-exp, from which the sink's share is taken out.
        lse = _EMPTY if sinks is None else q.new_empty(q.shape[:2], dtype=torch.float32)
        out = torch.ops.radixserve_cpu.paged_attention(
            q, k_buffer, v_buffer, k.to(q.dtype), v.to(q.dtype), meta.out_cache_loc, meta.items,
            meta.group_member_indptr, meta.group_kv_indptr, meta.member_q_start, meta.member_q_len,
            meta.member_q_pos0, meta.member_kv_indptr, meta.member_kv_pos0, meta.kv_slots, scaling, lse, self.amx,
            self.row_invariant,
        )
        return out if sinks is None else apply_sinks(out, lse, sinks)


    def _plan_window(self, batch: ForwardBatch, window: int) -> "CpuAttentionPlan | TorchNativeMetadata":
        if max(batch.extend_lens_cpu) > 1:
            return self.fallback.plan_window(batch, window)
        plan = plan_groups(batch, max_group_tokens=self.max_group_tokens, window=window)
        window_map = batch.token_to_kv_pool.window_map
        if window_map is not None:  # the window layers' own slot space (radix_cache/swa_pool.py)
            plan.kv_slots = window_map[plan.kv_slots].contiguous()
            plan.out_cache_loc = batch.window_cache_loc.to(torch.int64).contiguous()
        return plan


_EMPTY = torch.empty(0)


def kernel_dtypes(query: torch.dtype, pool: torch.dtype) -> bool:
    """Whether the kernel attends `query` rows over a pool of `pool`: one dtype of SUPPORTED_DTYPES but float16, or
    float32 queries over float16 keys and values (converted to float32 in registers), or over bfloat16 ones (the
    queries rounded to bfloat16: a bfloat16 model's attention, its output back in float32)."""
    return (query == pool and query != torch.float16) or (
        query == torch.float32 and pool in (torch.float16, torch.bfloat16))


def supported_head_dim(head_dim: int) -> bool:
    """The kernel works on 16-float vectors: head_dim a multiple of 16, at most 256."""
    return head_dim % 16 == 0 and head_dim <= 256


def plan_groups(batch: ForwardBatch, min_shared_prefix: int = 32, max_group_tokens: int = 64,
                window: Optional[int] = None) -> CpuAttentionPlan:
    """The kernel's description of `batch` (see the module docstring); with a sliding `window`, of a batch of one
    query a request, each reading its last `window` keys."""
    size = batch.batch_size
    shared, key_starts = [], [0] * size
    if window is not None:
        assert max(batch.extend_lens_cpu) == 1, "the kernel applies a window to one query a request only"
        key_starts = [max(0, prefix - window + 1) for prefix in batch.prefix_lens_cpu]
    elif size > 1 and min_shared_prefix != math.inf:
        shared, key_starts = find_shared_prefixes(batch, max(1, int(min_shared_prefix)))
    extend_lens, prefix_lens, seq_lens = batch.extend_lens_cpu, batch.prefix_lens_cpu, batch.seq_lens_cpu
    token_starts = [0]
    for length in extend_lens:
        token_starts.append(token_starts[-1] + length)

    # Groups as (shared slots or None, member request indices); the grouped requests first.
    groups: list[tuple[Optional[torch.Tensor], list[int]]] = []
    grouped = set()
    for prefix in shared:
        members, tokens = [], 0
        for m in prefix.members:
            if members and tokens + extend_lens[m] > max_group_tokens:
                groups.append((prefix.kv_indices, members))
                members, tokens = [], 0
            members.append(m)
            tokens += extend_lens[m]
        groups.append((prefix.kv_indices, members))
        grouped.update(prefix.members)
    groups.extend((None, [i]) for i in range(size) if i not in grouped)

    order = [m for _, members in groups for m in members]
    member_indptr = [0]
    shared_slots, shared_indptr = [], [0]
    items = []
    for g, (slots, members) in enumerate(groups):
        member_indptr.append(member_indptr[-1] + len(members))
        shared_len = 0 if slots is None else int(slots.numel())
        if slots is not None:
            shared_slots.append(slots)
        shared_indptr.append(shared_indptr[-1] + shared_len)
        if len(members) == 1:
            m = members[0]
            for begin in range(0, extend_lens[m], QUERY_BLOCK):
                end = min(begin + QUERY_BLOCK, extend_lens[m])
                cost = (end - begin) * (prefix_lens[m] + end)
                items.append((cost, g, begin, end))
        else:
            cost = sum(extend_lens[m] for m in members) * max(seq_lens[m] for m in members)
            items.append((cost, g, 0, 0))
    items.sort(key=lambda item: -item[0])

    device = batch.req_pool_indices.device
    index = torch.tensor(order, dtype=torch.int64, device=device)
    own_start = torch.tensor([key_starts[m] for m in order], dtype=torch.int64, device=device)
    own_len = batch.seq_lens[index] - own_start
    own_indptr = torch.zeros(len(order) + 1, dtype=torch.int64, device=device)
    torch.cumsum(own_len, 0, out=own_indptr[1:])
    owner = torch.repeat_interleave(torch.arange(len(order), device=device), own_len)
    columns = torch.arange(owner.numel(), device=device) - own_indptr[owner] + own_start[owner]
    rows = batch.req_pool_indices[index][owner]
    own_slots = batch.req_to_token_pool.req_to_token[rows, columns].to(torch.int64)

    def longs(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    num_shared = int(shared_indptr[-1])
    return CpuAttentionPlan(
        items=longs([item[1:] for item in items]).reshape(-1, 3),
        group_member_indptr=longs(member_indptr),
        group_kv_indptr=longs(shared_indptr),
        member_q_start=longs([token_starts[m] for m in order]),
        member_q_len=longs([extend_lens[m] for m in order]),
        member_q_pos0=longs([prefix_lens[m] for m in order]),
        member_kv_indptr=own_indptr + num_shared,
        member_kv_pos0=own_start,
        kv_slots=torch.cat([*shared_slots, own_slots]).to(torch.int64).contiguous(),
        out_cache_loc=batch.out_cache_loc.to(torch.int64).contiguous(),
        num_groups_shared=sum(1 for slots, members in groups if slots is not None and len(members) > 1),
    )
