"""Speculative decoding (n-gram drafts) in a real Scheduler: greedy outputs identical to plain decoding.

Prompts repeat a random span, so the n-gram proposer finds drafts, and the tiny random-weight model falls into
loops of its own, so many drafts are accepted. Every configuration (chunked prefill, pages, retraction, mixed
chunks, penalties, stop tokens, logprobs) must give exactly the plain scheduler's tokens, with the slot
invariants checked after every step, and acceptance must really happen.
"""

from __future__ import annotations

import random

import pytest

from scheduler_driver import SchedulerDriver

MAX_NEW_TOKENS = 40


def repetitive_prompts(seed: int, count: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        span = [rng.randrange(vocab) for _ in range(rng.randrange(4, 12))]
        noise = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        prompts.append(noise + span * rng.randrange(2, 4) if i % 4 else noise + span)
    return prompts


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return repetitive_prompts(7, 10)


def run(model_dir: str, prompts: list[list[int]], sampling: dict = None, **server_args) -> SchedulerDriver:
    server_args.setdefault("disable_overlap_schedule", True)
    driver = SchedulerDriver(model_dir, **server_args)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, **{"max_new_tokens": MAX_NEW_TOKENS, **(sampling or {})})
    driver.run_until_idle()
    return driver


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts) -> list[list[int]]:
    driver = run(tiny_llama, prompts)
    outputs = driver.outputs()
    driver.close()
    return outputs


CONFIGS = {
    "ngram": dict(),
    "short-chains": dict(speculative_num_draft_tokens=2),
    "num-steps": dict(speculative_num_steps=7),
    "chunk-16": dict(chunked_prefill_size=16),
    "mixed-chunk": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "page-4": dict(page_size=4, chunked_prefill_size=16),
    "window-2-to-4": dict(speculative_ngram_min_match_window_size=2, speculative_ngram_max_match_window_size=4),
    "overlap": dict(disable_overlap_schedule=False),
    "overlap-mixed-chunk": dict(disable_overlap_schedule=False, chunked_prefill_size=16, enable_mixed_chunk=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_to_plain_decoding(name, tiny_llama, prompts, plain):
    driver = run(tiny_llama, prompts, speculative_algorithm="NGRAM", **CONFIGS[name])
    assert driver.outputs() == plain
    spec = driver.scheduler.speculator
    assert spec.verify_steps > 0, spec.info()
    if "speculative_ngram_min_match_window_size" not in CONFIGS[name]:  # longer matches are rare in random text
        assert 0 < spec.num_accepted < spec.num_proposed, spec.info()  # accepted, and rejections recovered from
    # Fewer forward steps than tokens: accepted drafts saved decode steps.
    decode_like = spec.verify_steps + driver.scheduler.stats.decode_steps
    assert decode_like < sum(len(out) - 1 for out in plain)
    driver.close()


def test_retraction_keeps_outputs(tiny_llama, prompts, plain):
    # A pool too small for every request's chains: verify steps fall back to plain decode steps, which retract.
    driver = run(tiny_llama, prompts, speculative_algorithm="NGRAM", max_total_tokens=200)
    assert driver.scheduler.stats.num_retractions > 0
    assert driver.outputs() == plain
    assert driver.scheduler.speculator.num_accepted > 0
    driver.close()


@pytest.mark.parametrize("sampling", [
    dict(frequency_penalty=0.5, presence_penalty=0.3),
    dict(repetition_penalty=1.3),
    dict(min_new_tokens=30, stop_token_ids=[268, 338, 223]),
], ids=["frequency-presence", "repetition", "stop-ids"])
def test_greedy_identical_with_penalties_and_stops(sampling, tiny_llama, prompts):
    baseline = run(tiny_llama, prompts, sampling)
    expected = baseline.outputs()
    reasons = [r.finish_reason for r in baseline.results.values()]
    baseline.close()
    driver = run(tiny_llama, prompts, sampling, speculative_algorithm="NGRAM")
    assert driver.outputs() == expected
    assert [r.finish_reason for r in driver.results.values()] == reasons
    assert driver.scheduler.speculator.verify_steps > 0
    driver.close()


def test_logprobs_match_plain_decoding(tiny_llama, prompts):
    def results(**server_args):
        driver = SchedulerDriver(tiny_llama, disable_overlap_schedule=True, **server_args)
        for i, prompt in enumerate(prompts):
            driver.submit(f"r{i}", prompt, return_logprob=True, top_logprobs_num=3, max_new_tokens=16)
        driver.run_until_idle()
        accepted = driver.scheduler.speculator.num_accepted
        driver.close()
        return list(driver.results.values()), accepted

    expected, _ = results()
    got, accepted = results(speculative_algorithm="NGRAM")
    assert accepted > 0
    for want, have in zip(expected, got):
        assert have.output_ids == want.output_ids
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in have.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]


def test_abort_between_verify_steps_frees_every_slot(tiny_llama, prompts):
    driver = SchedulerDriver(tiny_llama, speculative_algorithm="NGRAM")
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    spec = driver.scheduler.speculator
    while spec.verify_steps < 3:
        driver.step()
    for i in range(0, len(prompts), 2):
        driver.abort(f"r{i}")
    driver.step()
    driver.run_until_idle()  # checks the slot accounting when idle: no draft's slot is leaked
    aborted = [driver.results[f"r{i}"].finish_reason["type"] for i in range(0, len(prompts), 2)]
    assert aborted == ["abort"] * len(aborted)
    driver.close()


def test_seeded_sampling_draws_the_plain_tokens(tiny_llama, prompts):
    """A seeded request's tokens are those of plain seeded sampling, whatever the drafts (the acceptance test is
    the plain draw compared with the draft)."""
    sampling = dict(temperature=0.8, top_p=0.9, seed=11)
    baseline = run(tiny_llama, prompts, sampling)
    expected = baseline.outputs()
    baseline.close()
    driver = run(tiny_llama, prompts, sampling, speculative_algorithm="NGRAM")
    assert driver.outputs() == expected
    assert driver.scheduler.speculator.num_accepted > 0
    # Again, with the tree now proposing the first run's outputs as drafts: still the same tokens.
    for i, prompt in enumerate(prompts):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS, **sampling)
    driver.run_until_idle()
    assert [driver.results[f"again{i}"].output_ids for i in range(len(prompts))] == expected
    driver.close()


@pytest.mark.parametrize("draft", ["itself", "other-seed"])
def test_standalone_draft_model_greedy_identical(draft, tiny_llama, tiny_model_dir, prompts, plain):
    draft_dir = tiny_llama if draft == "itself" else tiny_model_dir("llama", seed=1)
    driver = run(tiny_llama, prompts, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_dir,
                 speculative_num_draft_tokens=4)
    assert driver.outputs() == plain
    spec = driver.scheduler.speculator
    assert spec.verify_steps > 0 and spec.num_proposed > 0
    if draft == "itself":  # the target drafting for itself: (nearly) every draft is accepted
        assert spec.num_accepted >= 0.9 * spec.num_proposed, spec.info()
    driver.close()  # the idle check covers the draft model's rows and KV too


def test_standalone_with_retraction_and_abort(tiny_llama, prompts, plain):
    driver = run(tiny_llama, prompts[:6], speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama,
                 max_total_tokens=200)
    assert driver.scheduler.stats.num_retractions > 0
    assert driver.outputs() == plain[:6]
    driver.submit("late", prompts[7], max_new_tokens=MAX_NEW_TOKENS)
    for _ in range(4):
        driver.step()
    driver.abort("late")
    driver.run_until_idle()
    assert driver.results["late"].finish_reason["type"] == "abort"
    driver.close()


def test_tree_continuations_of_the_same_namespace_become_drafts(tiny_llama, prompts, plain):
    driver = run(tiny_llama, prompts[:2], speculative_algorithm="NGRAM")
    spec = driver.scheduler.speculator
    accepted_before, proposed_before = spec.num_accepted, spec.num_proposed
    # The same prompts again: the tree holds what the first requests produced, so it drafts the whole output.
    for i, prompt in enumerate(prompts[:2]):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    # And in another namespace, where the tree holds nothing of theirs: no tree drafts.
    driver.submit("other-tenant", prompts[0], namespace=("tenant-b",), max_new_tokens=MAX_NEW_TOKENS)
    from_tree_before = spec.proposer.num_from_tree
    driver.run_until_idle()
    assert [driver.results[f"again{i}"].output_ids for i in range(2)] == plain[:2]
    assert driver.results["other-tenant"].output_ids == plain[0]
    accepted, proposed = spec.num_accepted - accepted_before, spec.num_proposed - proposed_before
    assert spec.proposer.num_from_tree > from_tree_before
    assert accepted >= 0.6 * proposed, spec.info()
    driver.close()


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_overlap_with_staggered_arrivals(algorithm, tiny_llama, prompts, plain):
    """Overlap on: requests arriving while others decode get their prefill launched while a verify batch is in
    flight, and every output equals plain decoding's (overlap off)."""
    extra = dict(speculative_draft_model_path=tiny_llama) if algorithm == "STANDALONE" else {}
    driver = SchedulerDriver(tiny_llama, disable_overlap_schedule=False, speculative_algorithm=algorithm,
                             chunked_prefill_size=16, **extra)
    scheduler = driver.scheduler
    assert scheduler.overlap
    overlapped = []  # (batch launched, a verify batch was in flight then)
    launch = scheduler.executor.launch

    def recording_launch(batch):
        overlapped.append((batch.verify is None, any(b.batch.verify is not None for b in scheduler.inflight)))
        return launch(batch)

    scheduler.executor.launch = recording_launch
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
        for _ in range(3 if i % 3 == 0 else 0):  # some arrive while the earlier ones are decoding
            driver.step()
    driver.run_until_idle()
    assert driver.outputs() == plain
    assert scheduler.speculator.verify_steps > 0 and scheduler.speculator.num_accepted > 0
    assert any(plain_batch and verify_in_flight for plain_batch, verify_in_flight in overlapped), \
        "no batch ran while a verify batch was in flight"
    driver.close()


def test_overlap_abort_mid_verification_frees_every_slot(tiny_llama, prompts):
    driver = SchedulerDriver(tiny_llama, disable_overlap_schedule=False, speculative_algorithm="NGRAM")
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    spec = driver.scheduler.speculator
    while spec.verify_steps < 3:
        driver.step()
    assert driver.scheduler.inflight  # a verify batch is in flight while the aborts arrive
    for i in range(1, len(prompts), 2):
        driver.abort(f"r{i}")
    driver.run_until_idle()  # the idle check: no slot of a draft leaked
    assert all(driver.results[f"r{i}"].finish_reason["type"] == "abort" for i in range(1, len(prompts), 2))
    driver.close()


def _tree_paths(node, prefix=()):
    """Every root-to-leaf token sequence below `node` (a namespace root of a RadixCache)."""
    if not node.children:
        return [list(prefix)]
    return [path for child in node.children.values() for path in _tree_paths(child, prefix + tuple(child.key))]


def test_standalone_draft_tree_reuses_verified_prefixes(tiny_llama, tiny_model_dir, prompts, plain):
    """The draft model's radix tree: a request sharing a prefix with a finished one prefills only the rest for the
    draft model; the tree holds nothing but verified tokens (prefixes of prompt + outputs); flushed with the
    target's; outputs still identical to plain decoding."""
    draft_dir = tiny_model_dir("llama", seed=1)
    driver = SchedulerDriver(tiny_llama, disable_overlap_schedule=True, speculative_algorithm="STANDALONE",
                             speculative_draft_model_path=draft_dir, speculative_num_draft_tokens=4)
    proposer = driver.scheduler.speculator.proposer
    system = prompts[1][:9]
    shared = [system + prompt for prompt in prompts[:4]]
    sequences = []
    for i, prompt in enumerate(shared):  # one after another: each finds its predecessors' draft KV
        driver.submit(f"s{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
        driver.run_until_idle()
        sequences.append(prompt + driver.results[f"s{i}"].output_ids)
    assert proposer.num_reused_tokens >= 3 * len(system), proposer.num_reused_tokens
    ns_root = proposer.tree.root.children[()]
    paths = _tree_paths(ns_root)
    assert paths and all(any(seq[: len(path)] == path for seq in sequences) for path in paths)
    assert proposer.tree.evictable_size() > 0 and proposer.tree.protected_size() == 0
    # The same prompts again (now with the target's tree too): the same tokens as plain decoding from scratch.
    baseline = run(tiny_llama, shared)
    for i, prompt in enumerate(shared):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert [driver.results[f"again{i}"].output_ids for i in range(len(shared))] == baseline.outputs()
    assert [seq[len(p):] for seq, p in zip(sequences, shared)] == baseline.outputs()
    baseline.close()
    assert driver.flush_cache().success
    assert proposer.tree.evictable_size() == 0
    driver.close()


def test_standalone_draft_tree_evicts_when_the_draft_pool_is_short(tiny_llama, prompts, plain):
    driver = run(tiny_llama, prompts, speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama,
                 max_total_tokens=200)  # the draft runner sizes its pool like the target's
    assert driver.outputs() == plain
    proposer = driver.scheduler.speculator.proposer
    assert proposer.tree.evictable_size() + proposer.allocator.available_size() == proposer.allocator.size
    driver.close()
