"""Speculative verification: accept or reject draft tokens so that the output distribution is the target's.

The verify forward gives logits at every position of each request's chain `[last token, d_1, ..., d_k]`; row
j's distribution `p_j` is the target's next-token distribution after `d_j` (row 0: after the last token). Each
row is handled as the plain Sampler would handle it (penalties, bias, bans, temperature, top-k / top-p / min-p;
see sampling.py), giving the distribution `p_j` a plain decode step would draw from.

Rule (speculative sampling, Leviathan et al. / Chen et al.), for a draft distribution `q_j` that is a point mass
on `d_{j+1}` (n-gram drafts, and greedy draft models): accept `d` with probability `min(1, p_j(d) / q_j(d)) =
p_j(d)`; on the first rejection draw from the residual `max(0, p_j - q_j)`, i.e. `p_j` without `d`, renormalised;
when every draft is accepted draw one more token from `p_k`.

For a point-mass draft this is exactly "draw `x ~ p_j` as plain sampling would, accept `d` iff `x == d`, else emit
`x`": `P(accept) = p_j(d)`, and given a rejection `x` follows `p_j` without `d`, renormalised. radixserve
implements it that way, with the plain Sampler's own draw (the same uniform, `seeded_uniform(seed, position)`
for a seeded request): every emitted token is the token plain sampling would have drawn at that position, so a
seeded request gives the same tokens with or without speculative decoding, whatever the drafts were. A greedy
row's `p_j` is a point mass on its argmax: accept while the draft equals the argmax, then emit the argmax.

`verify_rows` decides every row at once (acceptance, and the token emitted if that row is where the chain stops);
the caller keeps the rows up to the first rejection of each chain (`chain_results`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from radixserve.model_runner.sampling import PLACEHOLDER_TOKEN_ID, adjusted_logits, draw, keep_thresholds
from radixserve.model_runner.sampling_info import SamplingBatchInfo


class VerifyRows(NamedTuple):
    accepted: torch.Tensor  # [R] bool: row j's draft (the next input token) is accepted
    fallback: torch.Tensor  # [R] int64: the token emitted if row j is where the chain stops
    no_token: torch.Tensor  # [R] bool: no token is possible at row j (constraints leave none)
    logprobs: Optional[torch.Tensor]  # [R, vocab] log-softmax of the adjusted logits, when asked


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The weights each row's plain sampling draws from, `[R, vocab]` (the kept probabilities, not renormalised,
    exactly as the Sampler computes them). `logits` must already carry the adjustments (penalties, bias, bans).
    Greedy rows are a point mass on their argmax."""
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
        probs[rows] = sampled
    return probs


def verify_rows(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    drafts: torch.Tensor,
    draw_uniforms: torch.Tensor,
    want_logprobs: bool = False,
) -> VerifyRows:
    """Decide every row of a verify batch.

    `logits [R, vocab]` float32 (edited in place), `info` the R rows' sampling parameters, `drafts [R]` the
    token that follows row j in its chain (-1 on a chain's last row), and one uniform in [0, 1) per row for its
    draw (the plain Sampler's uniform for that position).
    """
    logits, no_token = adjusted_logits(logits, info)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if info.all_greedy:  # every p_j is a point mass on its argmax: nothing to draw
        drawn = logits.argmax(dim=-1).masked_fill(no_token, PLACEHOLDER_TOKEN_ID)
        return VerifyRows((drafts >= 0) & (drafts == drawn) & ~no_token, drawn, no_token, logprobs)
    probs = torch.nan_to_num(target_probs(logits, info), nan=0.0)
    drawn = draw(probs, draw_uniforms, consume=True).clamp(max=logits.shape[1] - 1)
    if info.any_greedy:  # exact argmax, whatever the rounding of the cumulative sums
        drawn = torch.where(info.is_greedy, logits.argmax(dim=-1), drawn)
    drawn = drawn.masked_fill(no_token, PLACEHOLDER_TOKEN_ID)
    accepted = (drafts >= 0) & (drafts == drawn) & ~no_token
    return VerifyRows(accepted, drawn, no_token, logprobs)


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
