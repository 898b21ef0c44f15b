"""The verify step on the executor: one extend-like forward over every request's chain, then acceptance.

A verify batch is an EXTEND batch whose entry i is request i's chain `[last output, d_1, ..., d_k]` on top of
its KV (prefix `kv_len` before the step); logits are taken at every position of every chain. The executor
calls `enqueue_verify` instead of its plain sample; the scheduler reads the `VerifyResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.model_runner.sampling_info import SamplingBatchInfo
from radixserve.model_runner.spec_sampling import ChainResult, chain_results, verify_rows
from radixserve.model_runner.verify_forward import VerifyForward


@dataclass
class VerifyPlan:
    """What a verify batch carries besides the ScheduleBatch fields (`ScheduleBatch.verify`)."""

    chain_lens: list[int]  # per entry: 1 + its number of drafts
    drafts: list[int]  # per row: the draft that follows it in its chain, -1 on a chain's last row
    sampling_info: SamplingBatchInfo  # per row (a request's parameters repeated over its chain)
    draw_uniforms: torch.Tensor  # [R] float32: seeded rows' seeded_uniform(seed, position), NaN where unseeded
    logprob_rows: bool  # some request asked for logprobs
    top_logprobs_num: int

    @property
    def num_drafts(self) -> list[int]:
        return [length - 1 for length in self.chain_lens]


@dataclass
class VerifyResult:
    """Per entry: its chain's outcome, and the emitted tokens' logprobs / top logprobs when asked."""

    chains: list[ChainResult]
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[int, float]]]]] = None


class PendingVerify:
    """The executor's handle on a finished verify step (the CPU path runs it to completion at once)."""

    def __init__(self, result: VerifyResult) -> None:
        self._result = result

    def wait(self) -> VerifyResult:
        return self._result


def _fill_fresh(uniforms: torch.Tensor) -> torch.Tensor:
    fresh = torch.isnan(uniforms)
    if not bool(fresh.any()):
        return uniforms
    return torch.where(fresh, torch.rand(uniforms.shape, dtype=uniforms.dtype, device=uniforms.device), uniforms)


@torch.inference_mode()
def enqueue_verify(runner, forward_batch, plan: VerifyPlan, token_table: torch.Tensor,
                   verify_forward: Optional[VerifyForward] = None) -> PendingVerify:
    """Run the verify forward (in a CUDA graph where one fits: model_runner/verify_forward.py), decide every
    chain, and record each request's last emitted token in the token table (a later plain decode step reads its
    input there). Sampling decisions are broadcast from TP rank 0."""
    device = forward_batch.input_ids.device
    logits = (verify_forward or VerifyForward(runner))(forward_batch)
    drafts = torch.tensor(plan.drafts, dtype=torch.int64, device=device)
    rows = verify_rows(logits, plan.sampling_info, drafts, _fill_fresh(plan.draw_uniforms.to(device)),
                       want_logprobs=plan.logprob_rows)
    decided = runner.sync_sampled(torch.stack([rows.accepted.long(), rows.fallback, rows.no_token.long()]))
    rows = rows._replace(accepted=decided[0].bool(), fallback=decided[1], no_token=decided[2].bool())
    chains = chain_results(rows, plan.chain_lens, plan.drafts)

    result = VerifyResult(chains)
    starts = torch.tensor([0] + plan.chain_lens[:-1]).cumsum(0).tolist()
    last_tokens = [chain.tokens[-1] if chain.tokens else 0 for chain in chains]
    token_table[forward_batch.req_pool_indices] = torch.tensor(last_tokens, dtype=torch.int64, device=device)
    if rows.logprobs is not None:
        row_ids = [start + n for start, chain in zip(starts, chains) for n in range(len(chain.tokens))]
        token_ids = [token for chain in chains for token in chain.tokens]
        chosen = rows.logprobs[row_ids, token_ids].tolist() if row_ids else []
        top = None
        if plan.top_logprobs_num > 0 and row_ids:
            values, ids = torch.topk(rows.logprobs[row_ids], min(plan.top_logprobs_num, logits.shape[1]), dim=-1)
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        result.logprobs, result.top_logprobs, cursor = [], [] if top is not None else None, 0
        for chain in chains:
            count = len(chain.tokens)
            result.logprobs.append(chosen[cursor: cursor + count])
            if top is not None:
                result.top_logprobs.append(top[cursor: cursor + count])
            cursor += count
    return PendingVerify(result)
