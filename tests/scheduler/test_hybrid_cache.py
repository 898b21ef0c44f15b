"""A hybrid linear-attention model (tiny Qwen3.5) through a real scheduler: the prefix cache still hits.

The radix tree keeps state snapshots beside the KV of the attention layers (radix_cache/hybrid.py); a prefix is
resumed only where both exist. Every step is checked by the driver: KV slot accounting, locks, and every snapshot
slot free or held by one node (0 leaked). Greedy ids must equal Hugging Face's in every configuration:

- the radix cache on and off; chunked prefill of 16 (snapshots at every chunk boundary); overlap and mixed chunks;
- the same prompts again: each resumes from the snapshot at the end of its first run's tokens;
- a retraction mid-decode (a KV pool too small for every request) re-admits from the snapshot it left;
- abort and flush hand every snapshot back; namespaces never share one;
- the multi-turn workload (8 conversations x 6 turns): cached tokens on later turns at least 90% of what a dense
  model of the same size caches, with outputs equal to the cache off.
"""

from __future__ import annotations

import pytest
import torch

from scheduler_driver import SchedulerDriver
from test_hybrid_models import hybrid_references
from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, random_prompts

from radixserve.radix_cache.hybrid import HybridRadixCache


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_5")


@pytest.fixture(scope="module")
def references(model_dir):
    return hybrid_references(model_dir)


def run(model_dir, prompts, max_new_tokens=MAX_NEW_TOKENS, prefix="r", driver=None, **server_args):
    driver = driver or SchedulerDriver(model_dir, max_total_tokens=4096, max_running_requests=16, **server_args)
    for i, prompt in enumerate(prompts):
        driver.submit(f"{prefix}{i}", prompt, max_new_tokens=max_new_tokens)
    driver.run_until_idle()
    return driver, [driver.results[f"{prefix}{i}"].output_ids for i in range(len(prompts))]


def snapshots_free(driver) -> bool:
    pool = driver.runner.state_pool
    return pool.available_snapshots() + driver.scheduler.cache.num_snapshots() == pool.num_snapshot_slots


CONFIGS = {
    "no-radix-cache": dict(disable_radix_cache=True),
    "radix-cache": dict(disable_overlap_schedule=True),
    "overlap": dict(disable_overlap_schedule=False),
    "chunk-16": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    "mixed-chunk-overlap": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_equal_transformers_and_the_cache_hits_again(name, model_dir, references):
    prompts, expected = references
    driver, outputs = run(model_dir, prompts, **CONFIGS[name])
    assert outputs == expected
    cache = driver.scheduler.cache
    assert isinstance(cache, HybridRadixCache) == (name != "no-radix-cache")
    stats = driver.scheduler.stats
    assert (stats.partial_chunks > 0) == ("chunked_prefill_size" in CONFIGS[name])
    if name == "no-radix-cache":
        driver.close()
        return
    assert cache.num_snapshots() > 0 and snapshots_free(driver)
    # The same prompts again: a match keeps a prompt's last token to compute, and the tree left a snapshot one token
    # before the end of each prompt, so all the rest is a hit, as with a dense model.
    driver, again = run(model_dir, prompts, prefix="again", driver=driver)
    assert again == expected
    assert [driver.results[f"again{i}"].cached_tokens for i in range(len(prompts))] == [len(p) - 1 for p in prompts]
    driver.close()
    assert snapshots_free(driver) and cache.num_snapshots() == 0  # the flush gave every snapshot back


def test_chunk_boundaries_are_resume_points(model_dir, references):
    """A prompt prefilled in chunks of 16 leaves a snapshot at every chunk boundary: a later prompt that shares its
    first 40 tokens resumes at 32, the last boundary inside the shared part."""
    prompts, _ = references
    long_prompt = prompts[4]  # 90 tokens (20-token head + 70)
    driver, _ = run(model_dir, [long_prompt], max_new_tokens=2, chunked_prefill_size=16,
                    disable_overlap_schedule=True)
    other = long_prompt[:40] + random_prompts(512, [10], seed=99)[0]
    driver, [ids] = run(model_dir, [other], max_new_tokens=8, prefix="other", driver=driver)
    assert driver.results["other0"].cached_tokens == 32
    reference = hf_model(model_dir)
    assert ids == hf_greedy(reference, other, 8, [])
    driver.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_retraction_mid_decode_keeps_the_ids(overlap, model_dir, references):
    prompts, expected = references
    # 8 requests of up to 122 tokens in a pool of 300 slots: decode runs out of KV and retracts.
    driver = SchedulerDriver(model_dir, max_total_tokens=300, max_running_requests=16,
                             disable_overlap_schedule=not overlap)
    driver, outputs = run(model_dir, prompts, driver=driver)
    assert driver.scheduler.stats.num_retractions > 0
    assert outputs == expected
    driver.close()
    assert snapshots_free(driver)


def test_abort_and_namespaces(model_dir, references):
    prompts, expected = references
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=16,
                             disable_overlap_schedule=True)
    driver.submit("kept", prompts[4], max_new_tokens=MAX_NEW_TOKENS)
    driver.submit("aborted", prompts[7], max_new_tokens=MAX_NEW_TOKENS)
    driver.step()
    driver.abort("aborted")
    driver.run_until_idle()
    assert driver.results["kept"].output_ids == expected[4]
    assert driver.results["aborted"].finish_reason["type"] == "abort"
    # Another namespace shares neither KV nor snapshots with the default one.
    driver.submit("tenant", prompts[4], namespace=("tenant-b", ""), max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.results["tenant"].cached_tokens == 0 and driver.results["tenant"].output_ids == expected[4]
    driver.close()
    assert snapshots_free(driver)


def test_snapshot_budget_evicts_least_recently_used(model_dir, references):
    """With 4 snapshot slots only, the least recently used unlocked snapshots go first: of two waves of 4 requests,
    the second wave's final states are what is left, and a continuation of each of those resumes at its end; outputs
    stay those of the cache off."""
    prompts, expected = references
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, max_running_requests=4, max_mamba_cache_size=12 + 4,
                             disable_overlap_schedule=True)
    driver, outputs = run(model_dir, prompts, driver=driver)
    assert outputs == expected
    cache = driver.scheduler.cache
    assert driver.runner.state_pool.num_snapshot_slots == 4 and cache.num_snapshots() == 4
    continued = [p + ids + [7] for p, ids in zip(prompts, expected)]
    driver, second = run(model_dir, continued[4:], max_new_tokens=4, prefix="second", driver=driver)
    assert [driver.results[f"second{i}"].cached_tokens for i in range(4)] == [
        len(p) + MAX_NEW_TOKENS - 1 for p in prompts[4:]]
    driver, first = run(model_dir, continued[:4], max_new_tokens=4, prefix="first", driver=driver)
    assert all(driver.results[f"first{i}"].cached_tokens < len(p) for i, p in enumerate(prompts[:4]))
    driver.close()
    _, uncached = run(model_dir, continued, max_new_tokens=4, disable_radix_cache=True)
    assert first + second == uncached


# ---- the multi-turn workload ----------------------------------------------------------------------------------

NUM_CONVERSATIONS, NUM_TURNS, TURN_TOKENS, ANSWER_TOKENS = 8, 6, 12, 8


def multi_turn(model_dir, num_conversations=NUM_CONVERSATIONS, num_turns=NUM_TURNS, driver=None,
               **server_args) -> tuple[list[list[int]], list[int]]:
    """8 conversations x 6 turns (by default): each turn's prompt is the conversation so far (earlier prompts and
    answers) plus a new user message; the turns of all conversations go in together, turn by turn. Returns every
    answer and the cached tokens of each turn after the first, and closes the driver (`driver`, else one built with
    `server_args`, which may replace the pool sizes)."""
    driver = driver or SchedulerDriver(model_dir, **{"max_total_tokens": 8192, "max_running_requests": 16,
                                                     **server_args})
    messages = [random_prompts(512, [TURN_TOKENS] * num_turns, seed=100 + c) for c in range(num_conversations)]
    history = [[] for _ in range(num_conversations)]
    answers, cached = [], []
    for turn in range(num_turns):
        for c in range(num_conversations):
            history[c] = history[c] + messages[c][turn]
            driver.submit(f"c{c}t{turn}", history[c], max_new_tokens=ANSWER_TOKENS)
        driver.run_until_idle()
        for c in range(num_conversations):
            result = driver.results[f"c{c}t{turn}"]
            answers.append(result.output_ids)
            history[c] = history[c] + result.output_ids
            if turn:
                cached.append(result.cached_tokens)
    driver.close()
    return answers, cached


@pytest.mark.slow  # three runs of 48 requests (about a minute on 2 cores)
def test_multi_turn_caches_as_much_as_a_dense_model(model_dir, tiny_model_dir):
    dense_dir = tiny_model_dir("qwen3", num_hidden_layers=4)
    _, dense_cached = multi_turn(dense_dir, disable_overlap_schedule=True)
    answers, cached = multi_turn(model_dir, disable_overlap_schedule=True)
    uncached_answers, uncached = multi_turn(model_dir, disable_radix_cache=True)
    assert answers == uncached_answers and sum(uncached) == 0
    assert sum(dense_cached) > 0
    assert sum(cached) >= 0.9 * sum(dense_cached), (sum(cached), sum(dense_cached))
    assert torch.tensor(cached).min() > 0  # every later turn resumed from its conversation's last snapshot


@pytest.mark.slow  # starts the Engine's processes
def test_engine_serves_the_hybrid_with_cache_hits(model_dir, references):
    from radixserve import Engine

    prompts, expected = references
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    with Engine(model_path=model_dir, device="cpu", dtype="float32", chunked_prefill_size=16, log_level="warning",
                max_mamba_cache_size=256) as engine:
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)] == expected
        again = engine.generate(input_ids=prompts, sampling_params=params)
        assert [r["output_ids"] for r in again] == expected
        assert [r["meta_info"]["cached_tokens"] for r in again] == [len(p) - 1 for p in prompts]
