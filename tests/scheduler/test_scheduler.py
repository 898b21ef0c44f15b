"""Scheduler batching: greedy outputs equal Hugging Face generate, whatever the batching configuration.

Every configuration runs 16 prompts of different lengths submitted at once through a real Scheduler on a
real (tiny, random-weight) model, checking the slot-accounting invariants after every step. Radix cache on/off,
chunked prefill, overlap on/off, mixed chunks, every policy, pages of 4 tokens, and a KV pool so small that
requests are retracted must all give exactly the tokens of `transformers` greedy generation.
"""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_driver import SchedulerDriver

NUM_PROMPTS = 16
MAX_NEW_TOKENS = 12


def make_prompts(seed: int, count: int, vocab: int, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(min_len, max_len))] for _ in range(count)]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise generate() masks every token equal to the pad id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # A shared 24-token head on some prompts, so the radix cache really serves prefixes.
    head = make_prompts(99, 1, 512, 24, 25)[0]
    body = make_prompts(0, NUM_PROMPTS, 512)
    return [head + p if i % 3 == 0 else p for i, p in enumerate(body)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama, prompts, MAX_NEW_TOKENS)


def run_batch(model_dir: str, prompts: list[list[int]], **server_args) -> SchedulerDriver:
    driver = SchedulerDriver(model_dir, **server_args)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    for result in driver.results.values():
        assert result.finish_reason == {"type": "length", "length": MAX_NEW_TOKENS}
    return driver


CONFIGS = {
    "baseline": dict(disable_overlap_schedule=True),
    "overlap": dict(disable_overlap_schedule=False),
    "no-radix-cache": dict(disable_radix_cache=True),
    "chunk-16": dict(chunked_prefill_size=16, disable_overlap_schedule=False),
    "chunk-16-no-overlap": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    "mixed-chunk": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=False),
    "mixed-no-overlap": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=True),
    "lpm": dict(schedule_policy="lpm"),
    "dfs-weight": dict(schedule_policy="dfs-weight", chunked_prefill_size=16),
    "lof": dict(schedule_policy="lof"),
    "random": dict(schedule_policy="random"),
    "page-4": dict(page_size=4, chunked_prefill_size=16),
    "small-batches": dict(max_prefill_tokens=40, max_running_requests=5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_match_hf(name, tiny_llama, prompts, reference):
    driver = run_batch(tiny_llama, prompts, **CONFIGS[name])
    assert driver.outputs() == reference
    # The configuration really shaped the batches.
    stats = driver.scheduler.stats
    assert (stats.partial_chunks > 0) == ("chunked_prefill_size" in CONFIGS[name])
    assert (stats.mixed_batches > 0) == name.startswith("mixed")
    if name == "no-radix-cache":
        assert stats.cached_tokens == 0
    driver.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_outputs(overlap, page_size, tiny_llama, prompts, reference):
    # 16 requests of up to 64 tokens each in a pool of 240: admission optimism (new_token_ratio < 1)
    # runs out of memory mid-decode, and requests must be retracted and re-run.
    driver = run_batch(tiny_llama, prompts, max_total_tokens=240, page_size=page_size,
                       disable_overlap_schedule=not overlap)
    assert driver.scheduler.stats.num_retractions > 0
    assert driver.server_info()["num_retractions"] == driver.scheduler.stats.num_retractions
    assert driver.outputs() == reference
    driver.close()


def test_cached_prefix_is_not_recomputed(tiny_llama, prompts, reference):
    driver = run_batch(tiny_llama, prompts, disable_overlap_schedule=True)
    computed_once = driver.scheduler.stats.prefill_tokens_computed
    # The same prompts again: everything but the last token of each prompt comes from the cache.
    for i, prompt in enumerate(prompts):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    again = [driver.results[f"again{i}"] for i in range(len(prompts))]
    assert [r.output_ids for r in again] == reference
    assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
    assert driver.scheduler.stats.prefill_tokens_computed - computed_once == len(prompts)
    driver.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_shared_system_prompts_are_computed_once(overlap, tiny_llama):
    """Generated-shared-prefix workload submitted at once: each group's system prompt is computed once, even
    for requests that arrive in the same batch as the first of their group (they wait one batch)."""
    systems = make_prompts(30, 3, 512, 64, 65)
    questions = make_prompts(31, 12, 512, 8, 9)
    prompts = [systems[i % 3] + q for i, q in enumerate(questions)]
    expected = hf_greedy(tiny_llama, prompts, 4)
    driver = SchedulerDriver(tiny_llama, disable_overlap_schedule=not overlap)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=4)
    driver.run_until_idle()
    assert driver.outputs() == expected
    stats = driver.scheduler.stats
    assert stats.prefill_tokens_computed == 3 * 64 + 12 * 8
    assert stats.cached_tokens == 9 * 64
    # The group members attended their 64 shared positions once per group (cascade attention), and the
    # tokens still equal Hugging Face's.
    assert driver.runner.attn_backend.num_cascade_batches > 0
    driver.close()


def test_default_model_matches_hf_with_chunks_mixed_and_overlap(default_model_dir):
    """The embedded SmolLM2 model, chat-templated prompts, chunked prefill of 16 tokens with mixed decoding
    and overlap: the tokens equal Hugging Face greedy generation, EOS included."""
    import transformers

    from radixserve.runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    questions = ["What is 2+2?", "Name a color.", "Say hello in Spanish.", "What is the capital of Italy?",
                 "Write a haiku about rain.", "Count to five.", "What is water made of?", "Give me a fruit."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True)) for q in questions]
    driver = SchedulerDriver(default_model_dir, chunked_prefill_size=16, enable_mixed_chunk=True,
                             tokenizer=tokenizer)
    eos = list(driver.runner.model_config.eos_token_ids)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=10)
    driver.run_until_idle()
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for prompt, result in zip(prompts, driver.results.values()):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            assert result.output_ids == out[0, len(prompt):].tolist()
            if result.finish_reason["type"] == "stop":
                assert result.output_ids[-1] in eos
    driver.close()
