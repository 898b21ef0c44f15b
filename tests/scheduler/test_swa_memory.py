"""Hybrid sliding-window memory: a tiny Gemma 3 whose window layers keep their KV in window slots of their own.

The model (from `Gemma3TextConfig`, saved with `save_pretrained`): 4 layers, three of them sliding with a window of
16 positions, shorter than the prompts. The window slots of positions that left a running request's window are freed
after each batch (scheduler/window_release.py); the radix tree keeps the full KV of such tokens and resumes a prefix
only where its last 15 positions still have window KV (radix_cache/swa.py). The driver checks every step: full-slot
accounting, locks, and every window slot free or held by exactly one full slot in use (0 leaked of either kind).

- greedy ids equal Hugging Face's through the scheduler with the cache on and off, overlap, chunked prefill of 16,
  mixed chunks; the same prompts again hit all but their last token, with the same ids;
- a retraction mid-decode, abort, and namespaces keep the ids and leak nothing;
- under KV pressure, with the memory of a full-layout pool that runs two long requests at once, the window-aware
  layout runs at least twice as many, with the same ids.
"""

from __future__ import annotations

import pytest

from scheduler_driver import SchedulerDriver
from test_model_forward import hf_greedy, hf_model, random_prompts

from radixserve.radix_cache.pool import KVAllocator
from radixserve.radix_cache.swa import SWARadixCache
from radixserve.radix_cache.swa_pool import SWAKVAllocator, SWAKVPool

WINDOW = 16
MAX_NEW_TOKENS = 24
PROMPT_LENGTHS = [40, 17, 23, 1, 65, 30, 9, 50]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gemma3", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(model_dir):
    """HF's greedy ids of any prompt, computed once each."""
    model = hf_model(model_dir)
    cache: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, max_new_tokens, [])
        return cache[key]

    return greedy


def make_prompts() -> list[list[int]]:
    """8 prompts of 1 to 65 tokens, a shared 24-token head on some, so the tree shares prefixes across windows."""
    head = random_prompts(512, [24], seed=3)[0]
    return [head + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(512, PROMPT_LENGTHS, seed=7))]


def run(driver: SchedulerDriver, prompts, prefix: str, max_new_tokens: int = MAX_NEW_TOKENS, **submit):
    for i, prompt in enumerate(prompts):
        driver.submit(f"{prefix}{i}", prompt, max_new_tokens=max_new_tokens, **submit)
    driver.run_until_idle()
    return [driver.results[f"{prefix}{i}"] for i in range(len(prompts))]


def assert_nothing_leaks(driver: SchedulerDriver) -> None:
    """Flush the tree: every full slot and every window slot is free again."""
    allocator = driver.runner.allocator
    driver.close()
    allocator.check_window_invariants()
    assert allocator.available_size() == allocator.size
    assert allocator.window_available_size() == allocator.window_size


def test_pool_split_follows_the_ratio(model_dir):
    """The memory of 1,000 full-layout tokens, one full layer of four: F / 4 + 0.5 F * 3 / 4 = 1,000 tokens' bytes."""
    driver = SchedulerDriver(model_dir, max_total_tokens=1000, swa_full_tokens_ratio=0.5)
    allocator, pool = driver.runner.allocator, driver.runner.token_to_kv_pool
    assert isinstance(allocator, SWAKVAllocator) and isinstance(pool, SWAKVPool)
    assert (allocator.size, allocator.window_size) == (1600, 800)
    assert pool.window_layers == (True, True, False, True) and pool.window_sizes == (WINDOW,)
    assert [buffer.shape[0] for buffer in pool.k_buffer] == [801, 801, 1601, 801]
    assert isinstance(driver.scheduler.cache, SWARadixCache)
    driver.close()
    plain = SchedulerDriver(model_dir, max_total_tokens=1000, disable_hybrid_swa_memory=True)
    assert type(plain.runner.allocator) is KVAllocator and plain.runner.allocator.size == 1000
    assert plain.runner.token_to_kv_pool.window_map is None
    plain.close()


CONFIGS = {
    "radix-cache": dict(disable_overlap_schedule=True),
    "overlap": dict(disable_overlap_schedule=False),
    "chunk-16": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    "mixed-chunk-overlap": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=False),
    "no-radix-cache": dict(chunked_prefill_size=16, disable_radix_cache=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_equal_transformers_and_the_cache_hits_again(name, model_dir, reference):
    prompts = make_prompts()
    expected = [reference(p) for p in prompts]
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, max_running_requests=16, **CONFIGS[name])
    assert [r.output_ids for r in run(driver, prompts, "r")] == expected
    assert driver.scheduler.results.window_release.released_slots > 0  # windows were left and freed while running
    again = run(driver, prompts, "again")
    assert [r.output_ids for r in again] == expected
    hits = [r.cached_tokens for r in again]
    assert hits == ([0] * len(prompts) if "no-radix" in name else [len(p) - 1 for p in prompts])
    assert_nothing_leaks(driver)


def test_next_turn_resumes_after_the_answer(model_dir, reference):
    """A prompt extending an earlier prompt and its answer resumes at the end of the answer: its last W - 1 tokens
    kept their window KV, though the earlier request freed the rest of its windows."""
    prompts = make_prompts()[:4]
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, disable_overlap_schedule=True)
    first = run(driver, prompts, "t1")
    turns = [p + r.output_ids + extra for p, r, extra in zip(prompts, first, random_prompts(512, [5] * 4, seed=9))]
    second = run(driver, turns, "t2")
    assert [r.output_ids for r in second] == [reference(t) for t in turns]
    # The answer's last token was never fed back: the tree holds the prompt and all but the last output.
    assert [r.cached_tokens for r in second] == [len(p) + MAX_NEW_TOKENS - 1 for p in prompts]
    assert_nothing_leaks(driver)


def test_retraction_mid_decode_keeps_the_ids(model_dir, reference):
    """A pool too small for every request's whole output: requests are retracted mid-decode (their window-less tokens
    go to the tree) and re-run from where their window KV still is, with the same ids."""
    prompts = make_prompts()
    driver = SchedulerDriver(model_dir, max_total_tokens=130, disable_overlap_schedule=True)
    assert driver.runner.allocator.size == 152  # the memory of 130 full-layout tokens
    results = run(driver, prompts, "r", max_new_tokens=64)
    assert driver.scheduler.stats.num_retractions > 0
    assert [r.output_ids for r in results] == [reference(p, 64) for p in prompts]
    assert_nothing_leaks(driver)


def test_abort_and_namespaces(model_dir, reference):
    prompts = make_prompts()
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, chunked_prefill_size=16, disable_overlap_schedule=True)
    for i, prompt in enumerate(prompts):
        driver.submit(f"a{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    for _ in range(6):
        driver.step()
    for i in range(0, len(prompts), 2):
        driver.abort(f"a{i}")
    driver.run_until_idle()
    for i in range(1, len(prompts), 2):
        assert driver.results[f"a{i}"].output_ids == reference(prompts[i])
    # Namespaces never share: the same prompts under another salt hit at most the 24-token head that the salted
    # requests admitted before them computed, then everything in their own namespace.
    salted = run(driver, prompts, "s", namespace=("", "salt"))
    assert [r.output_ids for r in salted] == [reference(p) for p in prompts]
    assert salted[0].cached_tokens == 0 and all(r.cached_tokens <= 24 for r in salted)
    again = run(driver, prompts, "t", namespace=("", "salt"))
    assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
    assert_nothing_leaks(driver)


def max_concurrent(driver: SchedulerDriver, prompts, max_new_tokens: int) -> tuple[int, list[list[int]]]:
    """The most requests running at once over the run, and the outputs."""
    for i, prompt in enumerate(prompts):
        driver.submit(f"p{i}", prompt, max_new_tokens=max_new_tokens)
    most = 0
    while not driver.scheduler.is_idle():
        driver.step()
        most = max(most, len(driver.scheduler.running))
    return most, [driver.results[f"p{i}"].output_ids for i in range(len(prompts))]


def test_window_release_runs_twice_as_many_long_requests(model_dir, reference):
    """8 requests of 96-token prompts and 16 new tokens, in the memory of 256 full-layout tokens: the full layout runs
    at most two at once; with window slots (ratio 0.25: 585 full slots, 146 window slots) at least twice as many."""
    prompts = random_prompts(512, [96] * 8, seed=13)
    common = dict(max_total_tokens=256, chunked_prefill_size=32, max_running_requests=16,
                  disable_overlap_schedule=True, disable_radix_cache=True)
    full = SchedulerDriver(model_dir, disable_hybrid_swa_memory=True, **common)
    full_most, full_outputs = max_concurrent(full, prompts, 16)
    full.close()
    hybrid = SchedulerDriver(model_dir, swa_full_tokens_ratio=0.25, **common)
    assert (hybrid.runner.allocator.size, hybrid.runner.allocator.window_size) == (585, 146)
    hybrid_most, hybrid_outputs = max_concurrent(hybrid, prompts, 16)
    assert_nothing_leaks(hybrid)
    assert full_most <= 2 and hybrid_most >= 2 * full_most, (full_most, hybrid_most)
    assert hybrid_outputs == full_outputs == [reference(p, 16) for p in prompts]
