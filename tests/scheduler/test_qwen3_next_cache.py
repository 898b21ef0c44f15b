"""Qwen3-Next (the tiny hybrid with sparse feed-forward layers) through a real scheduler, checked by the driver after
every step (KV slot accounting, locks, every snapshot slot free or held by one node). Greedy ids equal Hugging Face's:

- the radix cache on and off, and chunked prefill of 16; the same prompts again resume from their snapshots;
- a retraction mid-decode (a KV pool too small for every request) re-admits from the snapshot it left;
- a multi-turn workload caches as much as a dense model does, with outputs equal to the cache off.
"""

from __future__ import annotations

import pytest

from scheduler_driver import SchedulerDriver
from test_hybrid_cache import multi_turn, run, snapshots_free
from test_hybrid_models import hybrid_references

from radixserve.radix_cache.hybrid import HybridRadixCache


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_next")


@pytest.fixture(scope="module")
def references(model_dir):
    return hybrid_references(model_dir)


CONFIGS = {
    "no-radix-cache": dict(disable_radix_cache=True),
    "radix-cache": dict(disable_overlap_schedule=True),
    "chunk-16": dict(chunked_prefill_size=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_equal_transformers_with_the_cache_on_and_off(name, model_dir, references):
    prompts, expected = references
    driver, outputs = run(model_dir, prompts, **CONFIGS[name])
    assert outputs == expected
    cache = driver.scheduler.cache
    assert isinstance(cache, HybridRadixCache) == (name != "no-radix-cache")
    assert (driver.scheduler.stats.partial_chunks > 0) == (name == "chunk-16")
    if name == "no-radix-cache":
        driver.close()
        return
    driver, again = run(model_dir, prompts, prefix="again", driver=driver)
    assert again == expected
    assert [driver.results[f"again{i}"].cached_tokens for i in range(len(prompts))] == [len(p) - 1 for p in prompts]
    driver.close()
    assert snapshots_free(driver) and cache.num_snapshots() == 0


def test_retraction_mid_decode_keeps_the_ids(model_dir, references):
    prompts, expected = references
    # 8 requests of up to 122 tokens in a pool of 300 slots: decode runs out of KV and retracts.
    driver = SchedulerDriver(model_dir, max_total_tokens=300, max_running_requests=16)
    driver, outputs = run(model_dir, prompts, driver=driver)
    assert driver.scheduler.stats.num_retractions > 0
    assert outputs == expected
    driver.close()
    assert snapshots_free(driver)


def test_multi_turn_caches_as_much_as_a_dense_model(model_dir, tiny_model_dir):
    """The Qwen3.5 check (tests/scheduler/test_hybrid_cache.py): 8 conversations x 6 turns cache at least 90% of what
    a dense model of the same depth caches on later turns, every later turn resumes, outputs equal the cache off."""
    _, dense_cached = multi_turn(tiny_model_dir("qwen3", num_hidden_layers=4), disable_overlap_schedule=True)
    answers, cached = multi_turn(model_dir, disable_overlap_schedule=True)
    uncached_answers, uncached = multi_turn(model_dir, disable_radix_cache=True)
    assert answers == uncached_answers and sum(uncached) == 0
    assert sum(cached) >= 0.9 * sum(dense_cached) > 0, (sum(cached), sum(dense_cached))
    assert min(cached) > 0  # every later turn resumed from its conversation's last snapshot
