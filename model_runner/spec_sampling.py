"""Speculative verification: accept or reject draft tokens so that the output distribution is the target's.

The verify forward gives logits at every position of each request's chain `[last token, d_1, ..., d_k]`; row
j's distribution `p_j` is the target's next-token distribution after `d_j` (row 0: after the last token). Each
row is handled as the plain Sampler would handle it (penalties, bias, bans, temperature, top-k / top-p / min-p;
see sampling.py), giving the distribution `p_j` a plain decode step would draw from.

Rule (speculative sampling, Leviathan et al. / Chen et al.), for a draft distribution `q_j` that is a point mass
on `d_{j+1}` (n-gram drafts, and greedy draft models):
- accept `d_{j+1}` with probability `min(1, p_j(d) / q_j(d)) = p_j(d)`;
- on the first rejection, draw from the residual `max(0, p_j - q_j)`, i.e. `p_j` with `d` removed, renormalised;
- when every draft is accepted, draw one more token from `p_k`.
Each emitted token is then distributed exactly as under plain sampling. A greedy row's `p_j` is a point mass on
its argmax, so the rule reduces to "accept while the draft equals the argmax, then emit the argmax": the greedy
output is the plain greedy output.

`verify_rows` decides every row at once (acceptance and the fallback token as if that row were the first
rejection); the caller keeps the rows up to the first rejection of each chain (`chain_results`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from radixserve.model_runner.sampling import PLACEHOLDER_TOKEN_ID, draw, keep_thresholds
from radixserve.model_runner.sampling_info import SamplingBatchInfo


class VerifyRows(NamedTuple):
    accepted: torch.Tensor  # [R] bool: row j's draft (the next input token) is accepted
    fallback: torch.Tensor  # [R] int64: the token emitted if row j is where the chain stops
    no_token: torch.Tensor  # [R] bool: no token is possible at row j (constraints leave none)
    logprobs: Optional[torch.Tensor]  # [R, vocab] log-softmax of the adjusted logits, when asked


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each row's plain sampling draws from, normalised: `[R, vocab]`. `logits` must already
    carry the adjustments (penalties, bias, bans). Greedy rows are a point mass on their argmax."""
    probs = torch.zeros_like(logits)
    if info.any_greedy:
        greedy_rows = info.is_greedy.nonzero().squeeze(1)
        probs[greedy_rows, logits[greedy_rows].argmax(dim=-1)] = 1.0
    if not info.all_greedy:
        rows = info.sampled_rows
        scaled = logits[rows] / info.temperatures[rows]
        scaled.clamp_(max=torch.finfo(scaled.dtype).max)
        sampled = torch.softmax(scaled, dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            thresholds = keep_thresholds(
                sampled, info.top_ks[rows], info.top_ps[rows], info.min_ps[rows], max_top_k=info.max_top_k,
                need_top_k=info.need_top_k, need_top_p=info.need_top_p, need_min_p=info.need_min_p,
            )
            sampled.masked_fill_(sampled < thresholds.unsqueeze(1), 0.0)
        probs[rows] = sampled / sampled.sum(dim=-1, keepdim=True)
    return probs


def verify_rows(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    draw_uniforms: torch.Tensor,
    want_logprobs: bool = False,
) -> VerifyRows:
    """Decide every row of a verify batch.

    `logits [R, vocab]` float32 (edited in place), `info` the R rows' sampling parameters, `drafts [R]` the
    token that follows row j in its chain (-1 on a chain's last row), and two uniforms in [0, 1) per row: one
    for the acceptance test, one for the fallback draw.
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    if info.adjustments is not None:
        info.adjustments.apply(logits)
        torch.nan_to_num_(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max, neginf=-math.inf)
    no_token = ~(logits.amax(dim=-1) > -math.inf)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    probs = torch.nan_to_num(target_probs(logits, info), nan=0.0)

    has_draft = drafts >= 0
    draft_ids = drafts.clamp(min=0)
    draft_prob = probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    accepted = has_draft & (accept_uniforms < draft_prob) & ~no_token
    # The residual: p without the rejected draft (a chain's last row has no draft and draws from p itself).
    residual = probs.scatter(1, draft_ids.unsqueeze(1), torch.where(has_draft, 0.0, draft_prob).unsqueeze(1))
    fallback = draw(residual, draw_uniforms, consume=True).clamp(max=logits.shape[1] - 1)
    if info.any_greedy:  # exact argmax, whatever the rounding of the cumulative sums
        fallback = torch.where(info.is_greedy, logits.argmax(dim=-1), fallback)
    fallback = fallback.masked_fill(no_token, PLACEHOLDER_TOKEN_ID)
    return VerifyRows(accepted, fallback, no_token, logprobs)


class ChainResult(NamedTuple):
    tokens: list[int]  # accepted drafts, then the fallback token (absent when no token was possible there)
    num_accepted: int
    no_token: bool  # the chain stopped at a row where no token was possible


def chain_results(rows: VerifyRows, chain_lens: Sequence[int], drafts: Sequence[int]) -> list[ChainResult]:
    """Per chain (rows `[start, start + chain_lens[i])`), the tokens it emits: drafts up to the first rejection,
    then that row's fallback. `drafts` is the host copy of the rows' draft ids."""
    accepted, fallback, no_token = rows.accepted.tolist(), rows.fallback.tolist(), rows.no_token.tolist()
    results, start = [], 0
    for length in chain_lens:
        num_accepted = 0
        while num_accepted < length - 1 and accepted[start + num_accepted]:
            num_accepted += 1
        stop = start + num_accepted
        tokens = list(drafts[start: stop])
        if not no_token[stop]:
            tokens.append(fallback[stop])
        results.append(ChainResult(tokens, num_accepted, no_token[stop]))
        start += length
    return results
