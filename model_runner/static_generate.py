"""One static batch straight through the ModelRunner, without a scheduler: for tests and benchmarks.

`greedy_generate` runs ONE batched extend over all prompts (different lengths), then batched decode steps,
each through a `ForwardBatch`, exactly as the scheduler will drive the runner. The two helpers below it
(`assign_kv_slots`, `make_forward_batch`) are the building blocks, also used by tests that need a cached
prefix in the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool

if TYPE_CHECKING:
    from radixserve.model_runner.runner_parts import RunnerParts


def assign_kv_slots(
    allocator: KVAllocator,
    req_to_token_pool: ReqToTokenPool,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
) -> torch.Tensor:
    """Allocate KV slots for each request's new tokens and record them in `req_to_token`.

    Request i owns row `rows[i]`, whose first `prefix_lens[i]` positions already hold its KV slots (and whose
    partial tail page, if any, it owns). Its `extend_lens[i]` new tokens get slots after them, written at
    positions `[prefix_lens[i], prefix_lens[i] + extend_lens[i])`. Returns the slots concatenated in request
    order (the batch's `out_cache_loc`). Raises MemoryError when the allocator is out of pages.
    """
    table = req_to_token_pool.req_to_token
    last_slots = [int(table[row, p - 1]) if p > 0 else -1 for row, p in zip(rows, prefix_lens)]
    slots = allocator.alloc_extend(last_slots, list(extend_lens))
    if slots is None:
        raise MemoryError(f"KV pool out of memory allocating {sum(extend_lens)} tokens")
    start = 0
    for row, p, n in zip(rows, prefix_lens, extend_lens):
        table[row, p:p + n] = slots[start:start + n].to(table.dtype)
        start += n
    return slots


def make_forward_batch(
    mode: ForwardMode,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    new_token_ids: Sequence[Sequence[int]],
    out_cache_loc: torch.Tensor,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: TokenToKVPool,
    logits_indices: Optional[torch.Tensor] = None,
) -> ForwardBatch:
    """A ForwardBatch for requests in `rows` extending their prefixes with `new_token_ids` (positions follow
    the prefixes). `out_cache_loc` must already be recorded in `req_to_token` (see `assign_kv_slots`)."""
    device = req_to_token_pool.device
    prefix_lens = [int(p) for p in prefix_lens]
    extend_lens = [len(ids) for ids in new_token_ids]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    flat_ids = [t for ids in new_token_ids for t in ids]
    positions = [pos for p, e in zip(prefix_lens, extend_lens) for pos in range(p, p + e)]

    def as_tensor(values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    return ForwardBatch(
        mode=mode,
        input_ids=as_tensor(flat_ids),
        positions=as_tensor(positions),
        out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
        req_pool_indices=as_tensor(rows),
        seq_lens=as_tensor(seq_lens),
        prefix_lens=as_tensor(prefix_lens),
        extend_lens=as_tensor(extend_lens),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        logits_indices=logits_indices,
    )


def greedy_generate(
    runner: "RunnerParts",
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Greedy continuations of `prompts`, batched: one extend over all prompts, then decode steps.

    A request stops after `max_new_tokens` tokens or after emitting a token in `stop_token_ids` (which is
    kept in its output, as Hugging Face `generate` does); finished requests leave the decode batch. All
    rows and KV slots taken are returned to the runner's pools, also on error.
    """
    assert prompts and all(prompts) and max_new_tokens >= 1
    stop = set(stop_token_ids)
    rows: list[int] = []
    seq_lens = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        for _ in prompts:
            row = runner.req_to_token_pool.alloc()
            if row is None:
                raise MemoryError("no free request rows in req_to_token_pool")
            rows.append(row)

        active = list(range(len(prompts)))
        new_tokens = [list(p) for p in prompts]
        mode = ForwardMode.EXTEND
        while active:
            active_rows = [rows[i] for i in active]
            prefix_lens = [seq_lens[i] for i in active]
            chunks = [new_tokens[i] for i in active]
            out_cache_loc = assign_kv_slots(
                runner.allocator, runner.req_to_token_pool, active_rows, prefix_lens, [len(c) for c in chunks]
            )
            for i, chunk in zip(active, chunks):
                seq_lens[i] += len(chunk)
            batch = make_forward_batch(
                mode, active_rows, prefix_lens, chunks, out_cache_loc,
                runner.req_to_token_pool, runner.token_to_kv_pool,
            )
            next_ids = runner.forward(batch).argmax(dim=-1).tolist()
            still_active = []
            for i, token in zip(active, next_ids):
                outputs[i].append(token)
                new_tokens[i] = [token]
                if len(outputs[i]) < max_new_tokens and token not in stop:
                    still_active.append(i)
            active = still_active
            mode = ForwardMode.DECODE
    finally:
        table = runner.req_to_token_pool.req_to_token
        for row, seq_len in zip(rows, seq_lens):
            if seq_len:
                runner.allocator.free(table[row, :seq_len].to(torch.int64))
            runner.req_to_token_pool.free(row)
    return outputs
