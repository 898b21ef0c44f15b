"""Batched sampling with per-request parameters: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

One step, for logits `[bs, vocab]` and a `SamplingBatchInfo`:

1. logit adjustments in place (repetition, frequency / presence penalties, logit bias, bans;
   see `penalties.py`);
2. logprobs, when asked, are the log_softmax of these adjusted logits: after penalties, bias and
   bans, before temperature and the top-k / top-p / min-p filters. They describe the model's
   (edited) distribution, not the truncated one the token was drawn from, so they are comparable
   across requests with different sampling settings;
3. greedy rows take the argmax of the adjusted logits (the first index on ties);
4. sampled rows: `probs = softmax(logits / temperature)`, then the top-k, top-p and min-p filters,
   then one draw from the kept tokens in proportion to their probabilities.

Filters. Each one keeps the tokens whose probability is at least a per-row threshold, all measured on
the same temperature-scaled distribution, so the kept set is their intersection and the order does
not matter:
- top-k: threshold = the k-th largest probability; a token tied with it is kept too (so the kept set
  depends only on the values, never on how a sort broke a tie);
- top-p: threshold = the probability of the last token of the smallest descending prefix whose
  cumulative probability reaches top_p (at least one token; ties at the cut are kept, as above;
  top_p = 1 keeps everything, whatever the rounding of the cumulative sum);
- min-p: threshold = min_p * the largest probability.
The largest probability always passes every filter, so at least one token is kept.

Drawing. Each sampled row uses one uniform u in [0, 1): the kept probabilities are accumulated
(cumsum) and the token is the first whose cumulative mass exceeds u * total, i.e. inverse-CDF
sampling of the renormalised kept distribution (no explicit renormalisation needed). A request with a
seed takes u = `seeded_uniform(seed, step)`, a pure function of its seed and output position, so its
tokens do not depend on the rest of the batch; unseeded rows draw u from the device's global
generator. One uniform per row (rather than one exponential per vocabulary entry, as in the
exponential-race trick) keeps the step cheap on CPU, where random number generation over a 150k
vocabulary for hundreds of rows would dominate.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.sampling_info import SamplingBatchInfo, seeded_uniform

__all__ = ["PLACEHOLDER_TOKEN_ID", "SampleOutput", "Sampler", "SamplingBatchInfo", "seeded_uniform", "keep_mask", "keep_thresholds"]

# On CPU, top-p first looks at each row's TOP_P_CANDIDATES largest probabilities; rows whose nucleus
# is wider look again at WIDER_TOP_P_CANDIDATES, and only rows wider still are fully sorted. Sorting a
# 150k vocabulary costs ~10 ms per row on CPU, a top-256 a small fraction of that, and the nucleus of
# a language model's next-token distribution is usually far smaller than the vocabulary.
TOP_P_CANDIDATES = 256
# The id given to a row where no token could be chosen (SampleOutput.no_token).
PLACEHOLDER_TOKEN_ID = 0
WIDER_TOP_P_CANDIDATES = 4096


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [bs] int64, always inside the vocabulary
    logprobs: Optional[torch.Tensor]  # [bs] float32: logprob of each chosen token, when asked
    top_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]]  # (values [bs, k], ids [bs, k]), when asked
    # [bs] bool: rows where no token could be chosen (every logit -inf or NaN: constraints that leave
    # nothing, or a broken forward pass). Their id is PLACEHOLDER_TOKEN_ID, which the caller must not emit.
    no_token: Optional[torch.Tensor] = None


def _top_p_from_prefix(values: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p thresholds from each row's largest probabilities `values [n, K]` (descending).

    Returns (thresholds [n], complete [n] bool); a row is incomplete when its K largest probabilities
    sum to less than top_p, so the cut lies beyond them (never when K is the whole vocabulary).
    """
    cumulative = values.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    keep_count = (before < top_ps.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    thresholds = values.gather(1, (keep_count - 1).unsqueeze(1)).squeeze(1)
    keep_all = top_ps >= 1.0
    thresholds = torch.where(keep_all, torch.zeros_like(thresholds), thresholds)
    complete = keep_all | (keep_count < values.shape[1]) | (cumulative[:, -1] >= top_ps)
    return thresholds, complete


def _top_p_thresholds(probs: torch.Tensor, values: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Top-p thresholds, starting from the descending prefix `values` and widening it where needed.

    Widening needs to know which rows are incomplete (a device-to-host sync), so it is only done when
    `values` does not already span the whole vocabulary; callers off the CPU pass the full sort.
    """
    thresholds, complete = _top_p_from_prefix(values, top_ps)
    vocab = probs.shape[1]
    width = values.shape[1]
    while width < vocab:
        incomplete = (~complete).nonzero().squeeze(1)
        if incomplete.numel() == 0:
            break
        width = WIDER_TOP_P_CANDIDATES if width < WIDER_TOP_P_CANDIDATES < vocab else vocab
        if width < vocab:
            wider = torch.topk(probs[incomplete], width, dim=-1, sorted=True).values
        else:
            wider = torch.sort(probs[incomplete], dim=-1, descending=True).values
        row_thresholds, row_complete = _top_p_from_prefix(wider, top_ps[incomplete])
        thresholds[incomplete] = row_thresholds
        complete[incomplete] = row_complete
    return thresholds


def keep_thresholds(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    *,
    max_top_k: int,
    need_top_k: bool,
    need_top_p: bool,
    need_min_p: bool,
) -> torch.Tensor:
    """Per-row probability thresholds `[n]`: token t of row r is kept iff `probs[r, t] >= thresholds[r]`.

    `probs [n, vocab]` are the temperature-scaled probabilities; `top_ks` is int64 with vocab = off,
    `top_ps` 1.0 = off, `min_ps` 0.0 = off; `max_top_k` is the largest active top_k. The `need_*`
    flags skip filters no row uses; a filter that is off for a row leaves its threshold at 0 either
    way, so a row's result does not depend on the other rows. Without top-p no sort is done (top-k
    uses torch.topk); with it, the CPU looks at the largest TOP_P_CANDIDATES first, other devices sort.
    """
    num_rows, vocab = probs.shape
    thresholds = torch.zeros(num_rows, dtype=probs.dtype, device=probs.device)
    values = None
    if need_top_k or need_top_p:
        width = max_top_k if need_top_k else 1
        if need_top_p:
            width = max(width, TOP_P_CANDIDATES if probs.device.type == "cpu" else vocab)
        width = min(width, vocab)
        if width < vocab:
            values = torch.topk(probs, width, dim=-1, sorted=True).values
        else:
            values = torch.sort(probs, dim=-1, descending=True).values
    if need_top_k:
        active = top_ks < vocab
        kth = values.gather(1, (top_ks.clamp(1, values.shape[1]) - 1).unsqueeze(1)).squeeze(1)
        thresholds = torch.maximum(thresholds, torch.where(active, kth, torch.zeros_like(kth)))
    if need_top_p:
        thresholds = torch.maximum(thresholds, _top_p_thresholds(probs, values, top_ps))
    if need_min_p:
        largest = values[:, 0] if values is not None else probs.max(dim=-1).values
        thresholds = torch.maximum(thresholds, min_ps.to(probs.dtype) * largest)
    return thresholds


def keep_mask(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """The bool mask `[n, vocab]` of tokens that may be sampled, for the given per-row filters.

    `top_ks` uses any value <= 0 or >= vocab for "off". Reads the flags from the tensors (a host
    sync), so it is meant for inspection and tests; the Sampler uses precomputed flags.
    """
    vocab = probs.shape[1]
    top_ks = torch.where((top_ks <= 0) | (top_ks >= vocab), torch.full_like(top_ks, vocab), top_ks)
    active_k = top_ks[top_ks < vocab]
    thresholds = keep_thresholds(
        probs,
        top_ks,
        top_ps,
        min_ps,
        max_top_k=int(active_k.max()) if active_k.numel() else 0,
        need_top_k=bool(active_k.numel()),
        need_top_p=bool((top_ps < 1.0).any()),
        need_min_p=bool((min_ps > 0.0).any()),
    )
    return probs >= thresholds.unsqueeze(1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor, *, consume: bool = False) -> torch.Tensor:
    """Inverse-CDF draw: for each row, the first token whose cumulative mass exceeds `u * total`.

    `probs [n, vocab]` are non-negative and need not sum to one (the masked rows do not); a token
    with probability 0 is never chosen, because its cumulative mass equals its predecessor's.
    `consume=True` accumulates in place, overwriting `probs` (saves a [n, vocab] allocation).
    """
    cumulative = probs.cumsum_(dim=-1) if consume else probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = uniforms.to(probs.dtype).unsqueeze(1) * total
    # u < 1, but u * total can round up to total; stay strictly below it so a token is always found.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def adjusted_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` as float32 with the batch's adjustments (penalties, bans, grammar masks) applied in place, and
    per row whether no token is left.

    An extreme penalty can push a logit to +inf (or NaN): such a token is kept the most likely one rather than
    turn the row's distribution into NaN. A row whose constraints leave no token has no distribution to sample
    from; the callers give it a placeholder id, so one request's impossible constraints never produce an
    out-of-vocabulary id that would fail the whole batch or poison the next batch's inputs.
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    if info.adjustments is not None:
        info.adjustments.apply(logits)
        torch.nan_to_num_(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max, neginf=-math.inf)
    return logits, ~(logits.amax(dim=-1) > -math.inf)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `[bs, vocab]` logits; on the CPU, once its kernels are loaded, by the C++ argmax
    (kernels/cpu_argmax.cpp: the same ids, first on ties and NaN first, about 3 ms -> well under 1 ms for a
    64-row decode batch of a 49k vocabulary)."""
    if logits.device.type == "cpu" and logits.shape[-1] > 0 and cpu_build.ready():
        return torch.ops.radixserve_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Picks the next token of every request in a batch; see the module docstring for the semantics.

    `batch_invariant` (deterministic inference): logprobs row by row, since a reduction over one row may be split
    across threads differently than over many (a request's logprobs would then depend on its batch's size)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        return self.sample(logits, info, return_logprob, top_logprobs_num)

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        """Sample from `logits [bs, vocab]` float32.

        `logits` is edited in place (the adjustments) and may be used as scratch space afterwards
        (temperature scaling), so its contents after the call are unspecified; copy it first if it
        is needed again. Returns the chosen ids, their logprobs when `return_logprob`, and the `top_logprobs_num`
        largest logprobs per row with their ids when that is > 0 (all from the adjusted logits,
        before temperature).
        """
        if logits.dim() != 2 or logits.shape[0] != info.batch_size or logits.shape[1] != info.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match batch {info.batch_size} x vocab {info.vocab_size}"
            )
        logits, no_token = adjusted_logits(logits, info)

        logprobs_all = None
        if return_logprob or top_logprobs_num > 0:
            if self.batch_invariant:
                logprobs_all = torch.cat([torch.log_softmax(row, dim=-1) for row in logits.split(1)])
            else:
                logprobs_all = torch.log_softmax(logits, dim=-1)

        if info.all_greedy:
            next_ids = greedy_ids(logits)
        elif info.any_greedy:
            next_ids = greedy_ids(logits)  # before _sample_rows, which may scale the logits
            next_ids[info.sampled_rows] = self._sample_rows(logits, info)
        else:
            next_ids = self._sample_rows(logits, info)

        next_ids = next_ids.masked_fill(no_token, PLACEHOLDER_TOKEN_ID)

        chosen_logprobs = None
        if return_logprob:
            chosen_logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        top = None
        if top_logprobs_num > 0:
            values, ids = torch.topk(logprobs_all, min(top_logprobs_num, info.vocab_size), dim=-1)
            top = (values, ids)
        return SampleOutput(next_ids, chosen_logprobs, top, no_token)

    @staticmethod
    def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Token ids `[n_sampled]` for the non-greedy rows, in `info.sampled_rows` order."""
        rows = info.sampled_rows
        every_row = not info.any_greedy
        # Indexing copies, so either way `scaled` is scratch space that may be divided in place.
        scaled = logits if every_row else logits[rows]
        scaled.div_(info.temperatures if every_row else info.temperatures[rows])
        scaled.clamp_(max=torch.finfo(scaled.dtype).max)  # a tiny temperature must not make a logit +inf
        # torch.softmax, not a hand-written max/exp/sum: its per-row result is bitwise the same whatever
        # the number of rows, which a plain sum reduction (split across threads for one long row) is not.
        probs = torch.softmax(scaled, dim=-1)

        if info.need_top_k or info.need_top_p or info.need_min_p:
            pick = (lambda t: t) if every_row else (lambda t: t[rows])
            thresholds = keep_thresholds(
                probs,
                pick(info.top_ks),
                pick(info.top_ps),
                pick(info.min_ps),
                max_top_k=info.max_top_k,
                need_top_k=info.need_top_k,
                need_top_p=info.need_top_p,
                need_min_p=info.need_min_p,
            )
            probs.masked_fill_(probs < thresholds.unsqueeze(1), 0.0)

        seeded = info.seeded if every_row else info.seeded[rows]
        uniforms = info.seeded_uniforms if every_row else info.seeded_uniforms[rows]
        if info.any_unseeded_sampled:
            fresh = torch.rand(uniforms.shape, dtype=torch.float32, device=uniforms.device)
            uniforms = torch.where(seeded, uniforms, fresh)
        return draw(probs, uniforms, consume=True)
