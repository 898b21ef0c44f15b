"""Speculative acceptance at the sampler level: the emitted tokens are distributed as plain sampling's.

A crafted chain of three rows (two drafts, then the bonus row) is verified 40,000 times with seeded uniforms.
The first emitted token must follow row 0's target distribution, and the second (emitted only when the first
draft was accepted) row 1's, by a chi-square test against distributions computed independently here in float64.
A sampler that redraws from the full distribution after a rejection (instead of the residual) fails the same
test, so the test can fail. Greedy rows must accept exactly the argmax.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.sampling_info import SamplingBatchInfo
from radixserve.model_runner.spec_sampling import chain_results, verify_rows
from radixserve.runtime.wire.messages import SamplingParams

VOCAB = 8
ROW_LOGITS = [
    [2.0, 1.2, 0.3, -0.5, 1.9, -1.0, 0.0, 0.7],
    [0.1, 2.5, -0.3, 1.7, 0.4, 1.1, -2.0, 0.9],
    [1.0, -1.0, 0.5, 0.2, 2.2, 0.0, 1.5, -0.4],
]
CHI2_LIMIT = 30.0  # above the 0.9999 quantile of chi-square for <= 7 degrees of freedom


def expected_distribution(logits: list[float], temperature: float, top_k: int) -> dict[int, float]:
    values = torch.tensor(logits, dtype=torch.float64) / temperature
    probs = torch.softmax(values, dim=0)
    kept = probs >= torch.topk(probs, top_k).values[-1]
    probs = torch.where(kept, probs, torch.zeros_like(probs))
    probs /= probs.sum()
    return {t: float(p) for t, p in enumerate(probs) if p > 0}


def chi_square(counts: list[int], expected: dict[int, float]) -> float:
    n = sum(counts)
    assert all(counts[t] == 0 for t in range(VOCAB) if t not in expected), (counts, expected)
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())


def verify_many(params: SamplingParams, drafts: list[int], n: int, seed: int = 0):
    """Verify `n` copies of the chain (ROW_LOGITS, `drafts`); the emitted tokens of each copy."""
    chain_len = len(drafts) + 1
    logits = torch.tensor(ROW_LOGITS[:chain_len], dtype=torch.float32).repeat(n, 1)
    info = SamplingBatchInfo.build([params] * (n * chain_len), [[]] * (n * chain_len), VOCAB, "cpu")
    row_drafts = (drafts + [-1]) * n
    generator = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(n * chain_len, generator=generator)
    rows = verify_rows(logits, info, torch.tensor(row_drafts), uniforms)
    return rows, chain_results(rows, [chain_len] * n, row_drafts)


@pytest.mark.parametrize("drafts", [[4, 1], [0, 6], [5, 3]], ids=["likely-drafts", "unlikely-second", "filtered-out"])
def test_emitted_tokens_follow_the_target_distribution(drafts):
    params = SamplingParams(temperature=0.9, top_k=6)
    n = 40000
    _, chains = verify_many(params, drafts, n)
    first = [chain.tokens[0] for chain in chains]
    p0 = expected_distribution(ROW_LOGITS[0], 0.9, 6)
    assert chi_square(torch.bincount(torch.tensor(first), minlength=VOCAB).tolist(), p0) < CHI2_LIMIT
    # The first draft is accepted exactly as often as the target gives it probability.
    accepted = sum(chain.num_accepted >= 1 for chain in chains)
    assert abs(accepted / n - p0.get(drafts[0], 0.0)) < 4 * (0.25 / n) ** 0.5
    # After an accepted first draft, the second token follows row 1's distribution.
    second = [chain.tokens[1] for chain in chains if chain.num_accepted >= 1]
    if len(second) > 2000:
        p1 = expected_distribution(ROW_LOGITS[1], 0.9, 6)
        assert chi_square(torch.bincount(torch.tensor(second), minlength=VOCAB).tolist(), p1) < CHI2_LIMIT
    # A draft the filters remove is never accepted.
    if drafts[0] not in p0:
        assert accepted == 0


def test_redrawing_from_the_full_distribution_is_detected():
    """The wrong rule (after a rejection, draw from p rather than from p without the draft) skews the emitted
    distribution towards the draft; the chi-square test above must catch it."""
    params = SamplingParams(temperature=0.9, top_k=6)
    n = 40000
    draft = 4
    rows, _ = verify_many(params, [draft], n)
    # Redraw every row's fallback from the full distribution: verify again with no drafts at all.
    full_rows, _ = verify_many(params, [], n, seed=1)
    tokens = torch.where(rows.accepted[0::2], torch.full((n,), draft), full_rows.fallback)
    p0 = expected_distribution(ROW_LOGITS[0], 0.9, 6)
    assert chi_square(torch.bincount(tokens, minlength=VOCAB).tolist(), p0) > 10 * CHI2_LIMIT


def test_greedy_rows_accept_exactly_the_argmax():
    params = SamplingParams(temperature=0.0)
    argmaxes = [max(range(VOCAB), key=row.__getitem__) for row in ROW_LOGITS]
    _, chains = verify_many(params, [argmaxes[0], argmaxes[1]], 4)
    assert all(chain.tokens == argmaxes and chain.num_accepted == 2 for chain in chains)
    _, chains = verify_many(params, [argmaxes[0], 7], 4)
    assert all(chain.tokens == argmaxes[:2] and chain.num_accepted == 1 for chain in chains)
    _, chains = verify_many(params, [3, argmaxes[1]], 4)
    assert all(chain.tokens == argmaxes[:1] and chain.num_accepted == 0 for chain in chains)
