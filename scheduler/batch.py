"""ScheduleBatch: what the scheduler decided to run in one step, and its conversion to a ForwardBatch.

A batch is a list of entries, one per request: `extend_lens[i]` new tokens on top of `prefix_lens[i]` tokens
already in KV. The new tokens' KV slots are allocated and recorded in `req_to_token` when the batch is built
(`allocate_slots`), so the next batch can be built before this one runs.

Input ids: an entry that decodes (one new token, the request's latest output) reads it from the device-side
token table (`table_entries`), where the previous batch's sampler wrote it; all other new tokens are known on
the host. That is what lets the overlap scheduler build batch N+1 before batch N's tokens reach the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode, PrefixGroups, StateSlots
from radixserve.model_runner.sampling_info import SamplingBatchInfo
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.scheduler.pooling import PoolingBatch
from radixserve.scheduler.req import Req
from radixserve.scheduler.stop import StopChecker
from radixserve.scheduler.sampling_reuse import SamplingInfoReuse

if TYPE_CHECKING:
    from radixserve.model_runner.logprobs import InputLogprobPlan
    from radixserve.scheduler.grammar import GrammarMask


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    rows: list[int]  # req_to_token rows
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]  # new tokens concatenated; a placeholder 0 where read from the token table
    table_entries: list[int]  # entries whose single new token is read from the token table
    out_cache_loc: torch.Tensor  # int64 slots of the new tokens, already recorded in req_to_token
    samples_output: list[bool]  # entry i's sampled token becomes an output (False: an unfinished chunk)
    sampling_info: SamplingBatchInfo
    return_logprob: bool
    top_logprobs_num: int
    # Extra logits rows for prompt-token logprobs (scheduler/input_logprobs.py), and the grammar entries'
    # allowed-token mask (scheduler/grammar.py); set by the scheduler after assembly, None when unused.
    input_logprobs: Optional[InputLogprobPlan] = None
    grammar_mask: Optional[GrammarMask] = None
    lora_names: Optional[list[Optional[str]]] = None  # per request; None when no request has an adapter
    # A speculative verify batch (scheduler/speculative/): its chains' drafts and per-row sampling; None otherwise.
    verify: Optional[Any] = None  # a scheduler.speculative.verify.VerifyPlan (speculative/ builds on this module)
    prefix_groups: Optional[PrefixGroups] = None  # DECODE batches, for cascade attention (scheduler/prefix_groups.py)
    pooling: Optional[PoolingBatch] = None  # the entries that pool (scheduler/pooling.py); None when none does
    # A hybrid model's recurrent-state slots per entry (scheduler/hybrid_state.py); None for other models.
    state_slots: Optional[StateSlots] = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_ids)

    def to_forward_batch(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        token_table: torch.Tensor,
        device: torch.device,
    ) -> ForwardBatch:
        """The runner's input; reads decode tokens from `token_table` (so run it in stream order after the
        batch that sampled them)."""
        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        extend_lens = torch.tensor(self.extend_lens, dtype=torch.int64)
        prefix_lens = torch.tensor(self.prefix_lens, dtype=torch.int64)
        input_ids = ints(self.input_ids)
        rows = ints(self.rows)
        if self.mode == ForwardMode.DECODE:
            positions = prefix_lens
            input_ids = token_table[rows]
        else:
            starts = torch.cumsum(extend_lens, 0) - extend_lens
            offsets = torch.arange(self.num_new_tokens) - torch.repeat_interleave(starts, extend_lens)
            positions = torch.repeat_interleave(prefix_lens, extend_lens) + offsets
            if self.table_entries:
                entries = torch.tensor(self.table_entries, dtype=torch.int64)
                input_ids[starts[entries].to(device)] = token_table[rows[entries.to(device)]]
        seq_lens_cpu = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        return ForwardBatch(
            mode=self.mode,
            input_ids=input_ids,
            positions=positions.to(device, non_blocking=True),
            out_cache_loc=self.out_cache_loc.to(device, non_blocking=True),
            req_pool_indices=rows,
            seq_lens=ints(seq_lens_cpu),
            prefix_lens=prefix_lens.to(device, non_blocking=True),
            extend_lens=extend_lens.to(device, non_blocking=True),
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=list(self.prefix_lens),
            extend_lens_cpu=list(self.extend_lens),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            lora_names=self.lora_names,
            prefix_groups=self.prefix_groups,
            state_slots=self.state_slots,
        )


def assemble_batch(
    mode: ForwardMode,
    extends: Sequence[tuple[Req, int, int, torch.Tensor]],
    decodes: Sequence[Req],
    decode_slots: Optional[torch.Tensor],
    stop_checker: StopChecker,
    vocab_size: int,
    device: torch.device,
    sampling_reuse: Optional[SamplingInfoReuse] = None,
) -> ScheduleBatch:
    """The batch of `extends` (request, prefix_len, extend_len, slots; kv_len already raised) followed by
    `decodes` (requests whose next token, already given a slot in `decode_slots`, is read from the token table).
    With `sampling_reuse`, the sampling tensors of the batch before are used again where they still apply."""
    reqs, prefix_lens, extend_lens, input_ids, samples, slot_parts = [], [], [], [], [], []
    for req, prefix_len, extend_len, slots in extends:
        reqs.append(req)
        prefix_lens.append(prefix_len)
        extend_lens.append(extend_len)
        input_ids.extend(req.all_ids[prefix_len: prefix_len + extend_len])
        samples.append(req.kv_len == req.fill_len())
        slot_parts.append(slots)
    table_entries = list(range(len(reqs), len(reqs) + len(decodes)))
    for req in decodes:
        reqs.append(req)
        prefix_lens.append(req.kv_len - 1)
        extend_lens.append(1)
        input_ids.append(0)
        samples.append(True)
    if decodes:
        slot_parts.append(decode_slots)
    sampling_reqs = [r for r, s in zip(reqs, samples) if s]

    def build() -> SamplingBatchInfo:
        return build_sampling_info(reqs, samples, stop_checker, vocab_size, device)

    return ScheduleBatch(
        mode=mode, reqs=reqs, rows=[req.req_pool_idx for req in reqs], prefix_lens=prefix_lens,
        extend_lens=extend_lens, input_ids=input_ids, table_entries=table_entries,
        out_cache_loc=torch.cat(slot_parts), samples_output=samples,
        sampling_info=sampling_reuse.get(reqs, samples, build) if sampling_reuse is not None else build(),
        return_logprob=any(r.return_logprob for r in sampling_reqs),
        top_logprobs_num=max((r.top_logprobs_num for r in sampling_reqs), default=0),
        lora_names=[r.lora_name for r in reqs] if any(r.lora_name for r in reqs) else None,
    )


def pages_needed(last_slots: Sequence[int], extend_lens: Sequence[int], page_size: int) -> int:
    """Fresh pages `KVAllocator.alloc_extend(last_slots, extend_lens)` will take."""
    if page_size == 1:
        return int(sum(extend_lens))
    total = 0
    for last, n in zip(last_slots, extend_lens):
        room = 0 if last < 0 else page_size - 1 - last % page_size
        total += -(-max(0, n - room) // page_size)
    return total


def allocate_slots(
    allocator: KVAllocator,
    cache,
    req_to_token_pool: ReqToTokenPool,
    rows: Sequence[int],
    kv_lens: Sequence[int],
    extend_lens: Sequence[int],
) -> Optional[torch.Tensor]:
    """KV slots for `extend_lens[i]` new tokens after position `kv_lens[i]` of row `rows[i]`, recorded in
    `req_to_token`; evicts from the cache when free pages are short. Returns None (allocating nothing) when
    even eviction cannot make room."""
    table = req_to_token_pool.req_to_token
    if allocator.page_size > 1 and any(kv_lens):  # the last slot only matters to fill a partial page
        rows_t = torch.tensor(rows, dtype=torch.int64)
        lens_t = torch.tensor(kv_lens, dtype=torch.int64)
        last = table[rows_t.to(table.device), (lens_t - 1).clamp(min=0).to(table.device)].tolist()
        last_slots = [s if n > 0 else -1 for s, n in zip(last, kv_lens)]
    else:
        last_slots = [-1] * len(rows)
    needed = pages_needed(last_slots, extend_lens, allocator.page_size) * allocator.page_size
    available = allocator.available_size()
    if available < needed:
        cache.evict(needed - available)
    if window_short := allocator.window_shortfall(needed):  # window slots (radix_cache/swa_pool.py) run out apart
        cache.evict_window(window_short)
    slots = allocator.alloc_extend(last_slots, list(extend_lens))
    if slots is None:
        return None
    slots = slots.to("cpu")
    if all(n == 1 for n in extend_lens):
        table[torch.tensor(rows, dtype=torch.int64), torch.tensor(kv_lens, dtype=torch.int64)] = slots.to(
            table.device, table.dtype
        )
    else:
        start = 0
        for row, kv_len, n in zip(rows, kv_lens, extend_lens):
            table[row, kv_len:kv_len + n] = slots[start:start + n].to(table.device, table.dtype)
            start += n
    return slots


def build_sampling_info(
    reqs: Sequence[Req],
    samples_output: Sequence[bool],
    stop_checker: StopChecker,
    vocab_size: int,
    device: torch.device,
) -> SamplingBatchInfo:
    """Sampling tensors for the entries of a batch whose KV lengths are already raised for it.

    The token sampled for entry i is output number `kv_len - prompt_len` of its request. Its history
    (penalties, the step of a seeded draw) is the outputs before it; when the latest of those is still in
    flight (overlap), a placeholder stands in for it: only its position matters unless the request has
    penalties, in which case the scheduler waited for it (see `needs_exact_history`).
    """
    params, histories, banned, prompts = [], [], [], []
    need_prompts = False
    for req, samples in zip(reqs, samples_output):
        params.append(req.sampling_params)
        prompts.append(req.origin_input_ids)
        need_prompts |= req.sampling_params.repetition_penalty != 1.0
        if not samples:
            histories.append(req.output_ids)
            banned.append([])
            continue
        num_before = req.kv_len - req.prompt_len
        history = req.output_ids[:num_before]
        if len(history) < num_before:
            assert not needs_exact_history(req), "penalised request sampled without its full history"
            history = history + [0] * (num_before - len(history))
        histories.append(history)
        banned.append(stop_checker.banned_token_ids(req, num_before))
    return SamplingBatchInfo.build(
        params, histories, vocab_size, device,
        prompt_ids=prompts if need_prompts else None,
        banned_token_ids=banned if any(banned) else None,
    )


def needs_exact_history(req: Req) -> bool:
    """Whether scheduling this request's next step reads the content of its earlier outputs: penalties, and
    speculative decoding (drafts continue the accepted tokens, and how many were accepted sets the KV length
    the next verify chain starts from), so under overlap the scheduler first waits for its batch in flight."""
    if req.spec is not None:
        return True
    return req.sampling_params.has_penalties()
