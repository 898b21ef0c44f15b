"""Batched sampling: filters, seeds, distributions, penalties, bias, bans and logprobs.

Every random choice here uses a fixed seed, so each test is deterministic.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch

from radixserve.model_runner.penalties import LogitAdjustments, history_counts
from radixserve.model_runner.sampling import (
    TOP_P_CANDIDATES,
    WIDER_TOP_P_CANDIDATES,
    Sampler,
    SamplingBatchInfo,
    draw,
    keep_mask,
    seeded_uniform,
)
from radixserve.runtime.wire.messages import SamplingParams as SP

sampler = Sampler()

# The CUDA cases run where a GPU is present; on GPUs top-p sorts instead of widening candidates.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def reference_keep(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The kept set, written plainly from the documented rules (ties at a cut are kept)."""
    vocab = len(probs)
    order = sorted(range(vocab), key=lambda t: -probs[t])
    threshold = 0.0
    if 0 < top_k < vocab:
        threshold = max(threshold, probs[order[top_k - 1]])
    if top_p < 1.0:
        mass_before, count = 0.0, 0
        for token in order:
            if mass_before >= top_p:
                break
            count += 1
            mass_before += probs[token]
        threshold = max(threshold, probs[order[max(count, 1) - 1]])
    if min_p > 0.0:
        threshold = max(threshold, min_p * max(probs))
    return {t for t in range(vocab) if probs[t] >= threshold}


def as_set(mask_row: torch.Tensor) -> set[int]:
    return set(mask_row.nonzero().flatten().tolist())


def mask_of(probs: list[float], top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    row = keep_mask(
        torch.tensor([probs]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )[0]
    return as_set(row)


def sample_many(logits_row: torch.Tensor, params: SP, n: int, seeded: bool, device: str = "cpu") -> torch.Tensor:
    """n independent draws from one row's logits: seeds 0..n-1 when `seeded`, else the global generator."""
    rows = [msgspec.structs.replace(params, seed=i) for i in range(n)] if seeded else [params] * n
    info = SamplingBatchInfo.build(rows, [[] for _ in range(n)], logits_row.shape[0], device)
    torch.manual_seed(0)
    return sampler(logits_row.to(device).repeat(n, 1), info).next_token_ids.cpu()


# -- the filters, checked on probabilities directly -------------------------------------------------

DYADIC = [0.5, 0.25, 0.125, 0.0625, 0.0625]  # exact in float32, as are all their partial sums


def test_top_k_mask_keeps_k_largest_and_ties():
    probs = [0.1, 0.3, 0.05, 0.2, 0.2, 0.15]
    assert mask_of(probs, top_k=1) == {1}
    assert mask_of(probs, top_k=2) == {1, 3, 4}  # 0.2 ties with the 2nd largest: both kept
    assert mask_of(probs, top_k=3) == {1, 3, 4}
    assert mask_of(probs, top_k=4) == {1, 3, 4, 5}
    for off in (-1, 0, 6, 100):
        assert mask_of(probs, top_k=off) == set(range(6))


def test_top_p_mask_boundaries():
    assert mask_of(DYADIC, top_p=0.5) == {0}  # the first token alone reaches 0.5
    assert mask_of(DYADIC, top_p=0.5000001) == {0, 1}
    assert mask_of(DYADIC, top_p=0.75) == {0, 1}
    assert mask_of(DYADIC, top_p=0.8) == {0, 1, 2}
    assert mask_of(DYADIC, top_p=0.9) == {0, 1, 2, 3, 4}  # cut at token 3; token 4 ties with it
    assert mask_of(DYADIC, top_p=1e-6) == {0}  # always at least one token
    assert mask_of([0.25] * 4, top_p=0.3) == {0, 1, 2, 3}  # all tied: nothing to break the tie by
    # Order in the vocabulary does not matter, only the values.
    assert mask_of([0.0625, 0.125, 0.5, 0.0625, 0.25], top_p=0.75) == {2, 4}


def test_top_p_one_keeps_everything_despite_rounding():
    # The cumulative sum reaches 1.0 in float32 before the tiny tail; top_p = 1 must keep the tail.
    probs = [1.0 - 3e-8] + [1e-9] * 30
    assert mask_of(probs, top_p=1.0) == set(range(31))
    assert mask_of(probs, top_p=0.999) == {0}


def test_min_p_mask():
    assert mask_of(DYADIC, min_p=0.25) == {0, 1, 2}  # threshold 0.125 is kept (drop only below it)
    assert mask_of(DYADIC, min_p=0.2) == {0, 1, 2}
    assert mask_of(DYADIC, min_p=0.125) == {0, 1, 2, 3, 4}
    assert mask_of(DYADIC, min_p=1.0) == {0}


def test_filters_combine_as_intersection():
    assert mask_of(DYADIC, top_k=4, top_p=0.9, min_p=0.0) == {0, 1, 2, 3, 4}  # top-k tie keeps 4
    assert mask_of(DYADIC, top_k=4, top_p=0.7) == {0, 1}
    assert mask_of(DYADIC, top_k=2, top_p=0.9) == {0, 1}
    assert mask_of(DYADIC, top_k=4, top_p=0.9, min_p=0.25) == {0, 1, 2}


def dyadic_probs(rng: random.Random, vocab: int, weights: list[int]) -> list[float]:
    """Probabilities w / 2^22 summing to exactly 1, so every partial sum is exact in float32."""
    total = 1 << 22
    body = [rng.choice(weights) for _ in range(vocab - 1)]
    assert sum(body) < total
    values = body + [total - sum(body)]
    rng.shuffle(values)
    return [v / total for v in values]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab,weights", [(50, [0, 1, 7, 100, 5000, 5000]), (6000, [500, 550, 600, 600])])
def test_mask_matches_reference_on_random_rows(vocab, weights, device):
    # The second case spreads the mass so thinly that most nuclei are wider than TOP_P_CANDIDATES, some
    # wider than WIDER_TOP_P_CANDIDATES: the CPU path widens its candidates, then sorts the whole row.
    rng = random.Random(vocab)
    rows, ks, ps, mins = [], [], [], []
    for _ in range(24):
        rows.append(dyadic_probs(rng, vocab, weights))
        ks.append(rng.choice([-1, 0, 1, 3, 17, vocab // 2, vocab]))
        ps.append(rng.choice([1.0, 0.5, 0.9, 0.99, rng.randrange(1, 1 << 22) / (1 << 22)]))
        mins.append(rng.choice([0.0, 0.0, 0.125, 0.5]))
    tensors = [torch.tensor(values, device=device) for values in (rows, ks, ps, mins)]
    mask = keep_mask(*tensors).cpu()
    for i in range(len(rows)):
        assert as_set(mask[i]) == reference_keep(rows[i], ks[i], ps[i], mins[i]), f"row {i}"
    if vocab > WIDER_TOP_P_CANDIDATES:
        nucleus_sizes = [len(reference_keep(r, -1, p, 0.0)) for r, p in zip(rows, ps) if p < 1.0]
        assert any(TOP_P_CANDIDATES < n < WIDER_TOP_P_CANDIDATES for n in nucleus_sizes)
        assert any(n > WIDER_TOP_P_CANDIDATES for n in nucleus_sizes)


# -- drawing ----------------------------------------------------------------------------------------


def test_draw_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4 + [[0.0, 0.0, 1.0, 0.0, 0.0]])
    uniforms = torch.tensor([0.0, 0.49, 0.5, 1.0 - 2**-24, 1.0 - 2**-24])
    assert draw(probs, uniforms).tolist() == [1, 1, 3, 3, 2]
    unnormalised = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    assert draw(unnormalised.repeat(3, 1), torch.tensor([0.7, 0.75, 0.99])).tolist() == [1, 2, 2]


# -- the Sampler end to end -------------------------------------------------------------------------

CRAFTED = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.04, 0.01]))

FILTER_CASES = [
    SP(top_k=3),
    SP(top_p=0.45),
    SP(top_p=0.7, temperature=2.0),
    SP(min_p=0.6),
    SP(top_k=5, top_p=0.75, min_p=0.3),
    SP(temperature=0.5, min_p=0.2),
    SP(),
]


def expected_probs(params: SP) -> dict[int, float]:
    probs = torch.softmax(CRAFTED.double() / params.temperature, -1).tolist()
    kept = reference_keep(probs, params.top_k, params.top_p, params.min_p)
    mass = sum(probs[t] for t in kept)
    return {t: probs[t] / mass for t in kept}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", FILTER_CASES)
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_tokens_are_exactly_the_kept_set(params, seeded, device):
    drawn = sample_many(CRAFTED, params, 3000, seeded, device)
    assert set(drawn.tolist()) == set(expected_probs(params))


CHI2_LIMIT = 30.0  # above the 0.9999 quantile of chi-square for <= 7 degrees of freedom (29.9 at 8)


@pytest.mark.parametrize("params", [SP(temperature=0.8, top_k=4), SP(top_p=0.7, temperature=2.0), SP()])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies_match_distribution(params, seeded, device):
    n = 20000
    counts = torch.bincount(sample_many(CRAFTED, params, n, seeded, device), minlength=8).tolist()
    expected = expected_probs(params)
    assert all(counts[t] == 0 for t in range(8) if t not in expected)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())
    assert chi2 < CHI2_LIMIT, (counts, expected)


def test_seeded_uniform_is_uniform_over_steps_and_seeds():
    bins = 20
    for values in (
        [seeded_uniform(42, step) for step in range(20000)],
        [seeded_uniform(seed, 0) for seed in range(20000)],
        [seeded_uniform(-seed, 7) for seed in range(20000)],
    ):
        assert all(0.0 <= u < 1.0 for u in values)
        hist = [0] * bins
        for u in values:
            hist[int(u * bins)] += 1
        expected = len(values) / bins
        assert sum((h - expected) ** 2 / expected for h in hist) < 50.0  # df 19: 0.9999 quantile is 46.1


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen)
    params = [SP(temperature=0.0), SP(top_k=1), SP(temperature=0.0, top_p=0.5, seed=3)] * 2
    info = SamplingBatchInfo.build(params, [[]] * 6, 500, "cpu")
    assert info.all_greedy and info.adjustments is None and not info.need_penalties
    out = sampler(logits.clone(), info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_mixed_batch_greedy_rows_and_sampled_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen) * 3
    params = [SP(temperature=0.0), SP(temperature=1.0, top_k=2), SP(temperature=0.0), SP(top_k=1, temperature=5.0)]
    out = sampler(logits.clone(), SamplingBatchInfo.build(params, [[]] * 4, 300, "cpu"))
    argmax = logits.argmax(-1)
    assert out.next_token_ids[[0, 2, 3]].tolist() == argmax[[0, 2, 3]].tolist()
    assert out.next_token_ids[1].item() in set(torch.topk(logits[1], 2).indices.tolist())


def run_steps(rows: list[tuple[SP, list[torch.Tensor]]], steps: int, vocab: int, device: str) -> list[list[int]]:
    """Decode `steps` tokens for every row, each with its own per-step logits; returns the outputs."""
    outputs: list[list[int]] = [[] for _ in rows]
    prompts = [[1, 2, 3] for _ in rows]
    for step in range(steps):
        info = SamplingBatchInfo.build([p for p, _ in rows], outputs, vocab, device, prompt_ids=prompts)
        logits = torch.stack([per_step[step] for _, per_step in rows]).to(device)
        next_ids = sampler(logits, info).next_token_ids.tolist()
        for out, token in zip(outputs, next_ids):
            out.append(token)
    return outputs


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_batch_independent(device):
    vocab, steps = 3000, 10
    gen = torch.Generator().manual_seed(7)

    def step_logits(scale: float = 1.0) -> list[torch.Tensor]:
        return [torch.randn(vocab, generator=gen) * scale for _ in range(steps)]

    target = SP(temperature=0.9, top_p=0.9, seed=1234)
    target_logits = step_logits(2.0)
    alone = run_steps([(target, target_logits)], steps, vocab, device)[0]
    assert run_steps([(target, target_logits)], steps, vocab, device)[0] == alone

    torch.manual_seed(999)  # the global generator's state must not matter to seeded rows
    batch = [
        (SP(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.3), step_logits()),
        (SP(temperature=1.1, top_k=400), step_logits()),
        (target, target_logits),
        (SP(temperature=0.7, min_p=0.05, seed=5, logit_bias={3: 2.0}), step_logits()),
        (target, target_logits),
        (SP(temperature=1.5, top_p=0.999), step_logits(0.2)),  # a nucleus wider than the first candidates
    ]
    together = run_steps(batch, steps, vocab, device)
    assert together[2] == alone and together[4] == alone
    other_seed = run_steps([(SP(temperature=0.9, top_p=0.9, seed=1235), target_logits)], steps, vocab, device)[0]
    assert other_seed != alone
    assert len(set(alone)) > 1  # the sampling really is random, not a disguised argmax


# -- penalties, bias and bans -----------------------------------------------------------------------


def adjusted(logits: list[float], params: SP, output: list[int], prompt: list[int], banned=None) -> list[float]:
    adj = LogitAdjustments.build(
        [params], [output], len(logits), "cpu", prompt_ids=[prompt], banned_token_ids=banned
    )
    tensor = torch.tensor([logits])
    adj.apply(tensor)
    return tensor[0].tolist()


BASE = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]  # all values below are exact in float32


def test_frequency_and_presence_penalties_exact():
    out = [0, 0, 2, 0, 5]
    assert adjusted(BASE, SP(frequency_penalty=0.5), out, []) == [0.5, -1.0, 0.0, -3.0, 1.0, -0.5]
    assert adjusted(BASE, SP(presence_penalty=0.25), out, []) == [1.75, -1.0, 0.25, -3.0, 1.0, -0.25]
    assert adjusted(BASE, SP(frequency_penalty=0.5, presence_penalty=0.25), out, [4]) == [
        0.25, -1.0, -0.25, -3.0, 1.0, -0.75,
    ]  # the prompt token 4 is not penalised
    assert adjusted(BASE, SP(frequency_penalty=-1.0), out, []) == [5.0, -1.0, 1.5, -3.0, 1.0, 1.0]


def test_repetition_penalty_exact_over_prompt_and_output():
    # Seen: 3 (prompt, negative -> times 2), 0 and 2 (output, positive -> divided by 2), 5 (zero stays 0).
    assert adjusted(BASE, SP(repetition_penalty=2.0), [0, 2, 0, 5], [3, 3]) == [1.0, -1.0, 0.25, -6.0, 1.0, 0.0]
    # A penalty below 1 rewards repetition the same way round.
    assert adjusted(BASE, SP(repetition_penalty=0.5), [1], [4]) == [2.0, -0.5, 0.5, -3.0, 2.0, 0.0]


def test_adjustment_order_repetition_then_additive_then_bias_then_bans():
    params = SP(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={4: -0.5, 1: 8.0})
    # token 0: 2 / 2 - 1 = 0 (the other order would give (2 - 1) / 2 = 0.5)
    # token 1: -1 + 8 = 7, then banned; token 4: 1 - 0.5
    result = adjusted(BASE, params, [0], [], banned=[[1]])
    assert result == [0.0, float("-inf"), 0.5, -3.0, 0.5, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_adjustments_match_plain_python_on_random_batches(device):
    rng = random.Random(11)
    vocab, bs = 40, 7
    params, outputs, prompts, banned = [], [], [], []
    for _ in range(bs):
        params.append(
            SP(
                repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
                frequency_penalty=rng.choice([0.0, 0.7, -0.4]),
                presence_penalty=rng.choice([0.0, 0.5]),
                logit_bias=rng.choice([None, {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}]),
            )
        )
        outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 30))])
        prompts.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 20))])
        banned.append(rng.sample(range(vocab), rng.choice([0, 2])))
    logits = [[rng.uniform(-4, 4) for _ in range(vocab)] for _ in range(bs)]

    expected = [row[:] for row in logits]
    for i, p in enumerate(params):
        for t in range(vocab):
            x = expected[i][t]
            if p.repetition_penalty != 1.0 and (t in prompts[i] or t in outputs[i]):
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[i].count(t)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            x += (p.logit_bias or {}).get(t, 0.0)
            expected[i][t] = -math.inf if t in banned[i] else x

    adj = LogitAdjustments.build(params, outputs, vocab, device, prompt_ids=prompts, banned_token_ids=banned)
    actual = torch.tensor(logits, device=device)
    adj.apply(actual)
    torch.testing.assert_close(actual.cpu(), torch.tensor(expected), rtol=1e-6, atol=1e-5)


def test_penalised_greedy_changes_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]] * 3)
    params = [
        SP(temperature=0.0),
        SP(temperature=0.0, frequency_penalty=0.3),
        SP(temperature=0.0, presence_penalty=1.0),
    ]
    info = SamplingBatchInfo.build(params, [[0, 0], [0, 0], [0]], 4, "cpu")
    assert info.need_penalties and info.all_greedy
    assert sampler(logits, info).next_token_ids.tolist() == [0, 1, 1]  # 3 - 0.6 and 3 - 1 fall below 2.5


def test_history_counts_are_distinct_pairs_with_counts():
    rows, ids, counts = history_counts([4, 0, 2], [[1, 1, 3], [], [3, 0, 3, 3]], 5)
    assert list(zip(rows.tolist(), ids.tolist(), counts.tolist())) == [(2, 0, 1), (2, 3, 3), (4, 1, 2), (4, 3, 1)]


def test_logit_bias_steers_greedy_and_sampled_rows():
    logits = torch.tensor([[5.0, 1.0, 0.0, -2.0]] * 3)
    params = [
        SP(temperature=0.0, logit_bias={3: 100.0}),
        SP(temperature=1.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}),
        SP(temperature=0.0, logit_bias={0: -4.5}),
    ]
    info = SamplingBatchInfo.build(params, [[]] * 3, 4, "cpu")
    assert info.need_logit_adjustments and not info.need_penalties
    adjusted_logits = logits.clone()
    assert sampler(adjusted_logits, info).next_token_ids.tolist() == [3, 3, 1]
    assert adjusted_logits[2].tolist() == [0.5, 1.0, 0.0, -2.0]  # bias is added exactly, in place


def test_banned_ids_are_never_chosen():
    logits = CRAFTED.repeat(2, 1)
    info = SamplingBatchInfo.build([SP(temperature=0.0)] * 2, [[], []], 8, "cpu", banned_token_ids=[[0], [0, 1]])
    out = sampler(logits.clone(), info, return_logprob=True)
    assert out.next_token_ids.tolist() == [1, 2]
    ban = [[0, 1, 2, 3]] * 3000
    torch.manual_seed(0)
    info = SamplingBatchInfo.build([SP(temperature=1.0)] * 3000, [[]] * 3000, 8, "cpu", banned_token_ids=ban)
    drawn = sampler(CRAFTED.repeat(3000, 1), info).next_token_ids
    assert set(drawn.tolist()) == {4, 5, 6, 7}


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_of_adjusted_logits_before_temperature(device):
    gen = torch.Generator().manual_seed(3)
    vocab = 200
    logits = (torch.randn(5, vocab, generator=gen) * 2).to(device)
    params = [
        SP(temperature=0.0),
        SP(temperature=0.3, top_k=20, seed=1),
        SP(temperature=2.0, top_p=0.8, frequency_penalty=0.4),
        SP(temperature=1.0, repetition_penalty=1.5, logit_bias={7: 3.0}),
        SP(temperature=0.0, presence_penalty=1.0),
    ]
    outputs = [[], [5, 6], [9, 9, 1], [7], [int(logits[4].argmax())]]
    info = SamplingBatchInfo.build(
        params, outputs, vocab, device, prompt_ids=[[2, 3]] * 5, banned_token_ids=[[], [], [], [1], []]
    )
    reference_logits = logits.clone()
    info.adjustments.apply(reference_logits)
    reference = torch.log_softmax(reference_logits, -1)

    out = sampler(logits.clone(), info, return_logprob=True, top_logprobs_num=4)
    chosen = out.next_token_ids
    assert torch.equal(out.logprobs, reference.gather(1, chosen[:, None]).squeeze(1))
    values, ids = out.top_logprobs
    expected_values, expected_ids = torch.topk(reference, 4, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)
    assert chosen[0].item() == reference_logits[0].argmax().item()
    assert chosen[4].item() == reference_logits[4].argmax().item() != outputs[4][0]
    assert out.logprobs[3].item() > -math.inf  # the banned token 1 was not chosen


def test_lists_that_do_not_match_the_batch_raise():
    with pytest.raises(ValueError):
        SamplingBatchInfo.build([SP(repetition_penalty=1.2)], [[]], 10, "cpu")
    with pytest.raises(ValueError):
        SamplingBatchInfo.build([SP()], [[], []], 10, "cpu")
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 11), SamplingBatchInfo.build([SP()], [[]], 10, "cpu"))
