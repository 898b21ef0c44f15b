"""Scheduler request lifecycle: aborts in every state, stop conditions, prefix reuse across namespaces,
max_new_tokens=0, logprobs, sampling under overlap, flush and server info, and rejected requests.

All on a real tiny random-weight model driven in-process (see scheduler_driver.py); the invariants are
checked after every step, and each test ends idle with every KV slot free or evictable.
"""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_driver import SchedulerDriver
from test_scheduler import hf_greedy, make_prompts

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def driver_for(model_dir: str, overlap: bool, **server_args) -> SchedulerDriver:
    return SchedulerDriver(model_dir, disable_overlap_schedule=not overlap, **server_args)


def greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, **server_args) -> list[list[int]]:
    driver = driver_for(model_dir, False, **server_args)
    for i, prompt in enumerate(prompts):
        driver.submit(f"g{i}", prompt, max_new_tokens=max_new_tokens)
    outputs = [r.output_ids for r in driver.run_until_idle().values()]
    driver.close()
    return outputs


# ---- aborts ------------------------------------------------------------------------------------------
@OVERLAP
def test_abort_in_every_state(overlap, tiny_llama):
    prompts = make_prompts(1, 6, 512, 8, 30)
    long_prompt = make_prompts(2, 1, 512, 120, 121)[0]
    expected = greedy(tiny_llama, prompts, 10)
    driver = driver_for(tiny_llama, overlap, chunked_prefill_size=32, max_running_requests=4)
    sched = driver.scheduler
    driver.submit("waiting", prompts[0], max_new_tokens=10)
    driver.abort("waiting")  # still queued
    driver.submit("chunked", long_prompt, max_new_tokens=10)
    for i, prompt in enumerate(prompts):
        driver.submit(f"ok{i}", prompt, max_new_tokens=10)
    driver.submit("running", prompts[1], max_new_tokens=10)
    driver.submit("queued-late", prompts[2], max_new_tokens=10)  # beyond max_running_requests for a while
    driver.step()
    assert sched.chunked_req is not None and sched.chunked_req.rid == "chunked"
    driver.abort("chunked")  # mid-prefill, its chunk possibly still in flight
    assert any(r.rid == "queued-late" for r in sched.waiting)
    driver.abort("queued-late")  # waiting behind max_running_requests
    while not any(r.rid == "running" for r in sched.running):
        driver.step()
    driver.step()
    driver.step()
    driver.abort("running")
    if overlap:
        # A request whose batch is still in flight.
        driver.step()
        in_flight = [r for launched in sched.inflight for r in launched.batch.reqs if not r.finished]
        assert in_flight
        driver.abort(in_flight[0].rid)
        aborted_in_flight = in_flight[0].rid
    results = driver.run_until_idle()
    aborted = {"waiting", "chunked", "running", "queued-late"} | ({aborted_in_flight} if overlap else set())
    for rid, result in results.items():
        if rid in aborted:
            assert result.finish_reason["type"] == "abort", rid
        else:
            assert result.output_ids == expected[int(rid[2:])]
    assert results["waiting"].output_ids == [] and results["chunked"].output_ids == []
    assert 0 < len(results["running"].output_ids) < 10
    assert sched.stats.num_aborted == len(aborted)
    info = driver.server_info()["memory"]
    assert info["free_tokens"] + info["evictable_tokens"] == info["total_tokens"]
    driver.close()


def test_random_aborts_leave_no_leak(tiny_llama):
    """40 streaming requests, half aborted at random points: the rest finish correctly, nothing leaks."""
    rng = random.Random(7)
    prompts = make_prompts(3, 40, 512, 4, 60)
    expected = greedy(tiny_llama, prompts, 12)
    driver = driver_for(tiny_llama, True, chunked_prefill_size=24, enable_mixed_chunk=True, max_total_tokens=900)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=12)
    to_abort = set(rng.sample(range(40), 20))
    abort_at = {i: rng.randrange(0, 40) for i in to_abort}
    step = 0
    while not driver.scheduler.is_idle():
        for i, when in abort_at.items():
            if when == step:
                driver.abort(f"r{i}")
        driver.step()
        step += 1
    for i, prompt in enumerate(prompts):
        result = driver.results[f"r{i}"]
        if result.finish_reason["type"] == "abort":
            assert i in to_abort
            assert result.output_ids == expected[i][: len(result.output_ids)]
        else:
            assert result.output_ids == expected[i]
    driver.close()


# ---- stop conditions ----------------------------------------------------------------------------------
@OVERLAP
def test_stop_token_ids_and_min_new_tokens(overlap, tiny_llama):
    prompt = make_prompts(4, 1, 512, 10, 11)[0]
    full = greedy(tiny_llama, [prompt], 24)[0]
    stop_id = full[5]
    first = full.index(stop_id)
    driver = driver_for(tiny_llama, overlap)
    driver.submit("stop", prompt, max_new_tokens=24, stop_token_ids=[stop_id])
    driver.submit("min", prompt, max_new_tokens=24, stop_token_ids=[stop_id], min_new_tokens=first + 2)
    results = driver.run_until_idle()
    assert results["stop"].output_ids == full[: first + 1]
    assert results["stop"].finish_reason == {"type": "stop", "matched": stop_id}
    # Banned below min_new_tokens, so the output leaves the greedy path at `first`.
    held = results["min"].output_ids
    assert held[:first] == full[:first] and held[first] != stop_id
    assert stop_id not in held[: first + 2]
    assert len(held) >= first + 2
    driver.close()


@OVERLAP
def test_eos_and_ignore_eos(overlap, tiny_model_dir):
    prompt = make_prompts(5, 1, 512, 12, 13)[0]
    plain_dir = tiny_model_dir("llama")
    full = greedy(plain_dir, [prompt], 16)[0]
    eos = full[6]
    eos_dir = tiny_model_dir("llama", eos_token_id=eos)  # same seed, same weights, now with an EOS id
    driver = driver_for(eos_dir, overlap)
    driver.submit("eos", prompt, max_new_tokens=16)
    driver.submit("ignore", prompt, max_new_tokens=16, ignore_eos=True)
    results = driver.run_until_idle()
    assert results["eos"].output_ids == full[: full.index(eos) + 1]
    assert results["eos"].finish_reason == {"type": "stop", "matched": eos}
    assert results["ignore"].output_ids == full
    assert results["ignore"].finish_reason == {"type": "length", "length": 16}
    driver.close()


@OVERLAP
def test_stop_string_split_across_tokens(overlap, tiny_model_dir):
    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    from radixserve.runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode("The quick brown fox")
    full = greedy(model_dir, [prompt], 30)[0]
    pieces = [tokenizer.decode(full[: i + 1]) for i in range(len(full))]
    # A stop string made of the end of one token's text and the start of the next one's.
    for k in range(3, len(full) - 1):
        a, b = tokenizer.decode([full[k]]), tokenizer.decode([full[k + 1]])
        if len(a.strip()) >= 2 and len(b.strip()) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            break
    else:
        pytest.skip("no two printable tokens in a row")
    completes = next(i for i, text in enumerate(pieces) if stop in text)
    driver = driver_for(model_dir, overlap)
    driver.submit("s", prompt, max_new_tokens=30, stop=[stop, "never-generated-xyz"])
    results = driver.run_until_idle()
    assert results["s"].finish_reason == {"type": "stop", "matched": stop}
    assert results["s"].output_ids == full[: completes + 1]
    driver.close()


# ---- prefix cache -------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_cached_tokens_and_namespaces(page_size, tiny_llama):
    shared = make_prompts(6, 1, 512, 300, 301)[0]
    first, second = make_prompts(8, 2, 512, 20, 21)
    second[0] = (first[0] + 1) % 512  # the two diverge right after the shared prefix
    expected = greedy(tiny_llama, [shared + second], 8)[0]
    driver = driver_for(tiny_llama, True, page_size=page_size, chunked_prefill_size=128)
    driver.submit("a", shared + first, max_new_tokens=8)
    driver.run_until_idle()
    driver.submit("b", shared + second, max_new_tokens=8)
    driver.run_until_idle()
    driver.submit("b-salted", shared + second, max_new_tokens=8, namespace=("", "salt:x"))
    driver.run_until_idle()
    results = driver.results
    assert results["a"].cached_tokens == 0
    assert results["b"].cached_tokens == 300 // page_size * page_size
    assert results["b-salted"].cached_tokens == 0
    assert results["b-salted"].output_ids == results["b"].output_ids
    assert results["b"].output_ids == expected
    info = driver.server_info()
    assert info["cache"]["matched_tokens"] == 300 // page_size * page_size
    driver.close()


@OVERLAP
def test_max_new_tokens_zero_prefills_and_caches(overlap, tiny_llama):
    prompt = make_prompts(9, 1, 512, 40, 41)[0]
    expected = greedy(tiny_llama, [prompt], 5)[0]
    driver = driver_for(tiny_llama, overlap)
    driver.submit("warm", prompt, max_new_tokens=0)
    driver.run_until_idle()
    assert driver.results["warm"].output_ids == []
    assert driver.results["warm"].finish_reason == {"type": "length", "length": 0}
    driver.submit("use", prompt, max_new_tokens=5)
    driver.run_until_idle()
    assert driver.results["use"].cached_tokens == len(prompt) - 1
    assert driver.results["use"].output_ids == expected
    driver.close()


# ---- logprobs and sampling -------------------------------------------------------------------------------
@OVERLAP
def test_logprobs_match_hf(overlap, tiny_llama):
    import transformers

    prompt = make_prompts(10, 1, 512, 15, 16)[0]
    driver = driver_for(tiny_llama, overlap)
    driver.submit("lp", prompt, max_new_tokens=8, return_logprob=True, top_logprobs_num=3)
    driver.submit("plain", prompt[:-1], max_new_tokens=8)  # a neighbour without logprobs
    result = driver.run_until_idle()["lp"]
    assert len(result.logprobs) == len(result.top_logprobs) == 8
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([prompt + result.output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    for i, token in enumerate(result.output_ids):
        row = logprobs[len(prompt) - 1 + i]
        assert result.logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
        top_ids = [t for t, _ in result.top_logprobs[i]]
        assert top_ids[0] == token and len(top_ids) == 3
        assert top_ids == row.topk(3).indices.tolist()
    driver.close()


def test_sampling_identical_with_and_without_overlap(tiny_llama):
    """Seeded sampling, penalties and mixed lengths give the same tokens whether or not the scheduler overlaps."""
    prompts = make_prompts(11, 8, 512, 5, 30)
    params = [
        dict(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=12),
        dict(temperature=1.0, top_k=20, seed=2, max_new_tokens=7),
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, max_new_tokens=12),
        dict(temperature=0.0, repetition_penalty=1.3, max_new_tokens=9),
        dict(temperature=0.7, min_p=0.05, seed=3, max_new_tokens=1),
        dict(temperature=0.0, max_new_tokens=0),
        dict(temperature=0.5, seed=4, frequency_penalty=0.2, max_new_tokens=12),
        dict(temperature=0.0, logit_bias={5: 100.0}, max_new_tokens=3),
    ]
    runs = []
    for overlap in (False, True):
        driver = driver_for(tiny_llama, overlap, chunked_prefill_size=16, enable_mixed_chunk=True)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            driver.submit(f"r{i}", prompt, **p)
        runs.append([r.output_ids for r in driver.run_until_idle().values()])
        driver.close()
    assert runs[0] == runs[1]
    assert runs[0][7] == [5, 5, 5]
    assert [len(out) for out in runs[0]] == [p["max_new_tokens"] for p in params]


# ---- control ---------------------------------------------------------------------------------------------
def test_flush_cache_only_when_idle(tiny_llama):
    driver = driver_for(tiny_llama, True)
    driver.submit("r", make_prompts(12, 1, 512, 20, 21)[0], max_new_tokens=6)
    driver.step()
    reply = driver.flush_cache()
    assert not reply.success and "running" in reply.message
    driver.run_until_idle()
    assert driver.server_info()["memory"]["evictable_tokens"] > 0
    assert driver.flush_cache().success
    info = driver.server_info()
    assert info["memory"]["evictable_tokens"] == 0
    assert info["memory"]["free_tokens"] == info["memory"]["total_tokens"] == info["max_total_num_tokens"]
    for key in ("num_running_reqs", "num_queued_reqs", "token_usage", "gen_throughput", "num_retractions",
                "prefill_tokens_computed", "decode_steps", "context_len", "vocab_size", "eos_token_ids",
                "page_size", "device", "dtype", "attention_backend", "max_running_requests"):
        assert key in info, key
    assert info["decode_steps"] > 0 and info["prefill_tokens_computed"] == 20
    driver.close()


def test_requests_it_cannot_serve_are_aborted_with_a_reason(tiny_llama):
    """The scheduler checks only what it alone knows (the TokenizerManager checked the rest): its KV pool and
    whether it has a tokenizer for stop strings."""
    driver = driver_for(tiny_llama, True, max_total_tokens=64)
    driver.submit("too-big-for-the-pool", [1] * 60, max_new_tokens=8)
    driver.submit("stop-string", [1, 2, 3], max_new_tokens=4, stop=["x"])  # this model has no tokenizer
    driver.submit("fine", [1, 2, 3], max_new_tokens=4)
    results = driver.run_until_idle()
    for rid in ("too-big-for-the-pool", "stop-string"):
        reason = results[rid].finish_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400 and reason["message"], rid
    assert "KV pool" in results["too-big-for-the-pool"].finish_reason["message"]
    assert results["fine"].finish_reason == {"type": "length", "length": 4}
    driver.close()


def test_greedy_matches_hf_with_random_arrivals(tiny_llama):
    """Requests arriving while others decode (continuous batching) still give HF's tokens."""
    prompts = make_prompts(13, 12, 512, 3, 50)
    expected = hf_greedy(tiny_llama, prompts, 10)
    driver = driver_for(tiny_llama, True, chunked_prefill_size=16, enable_mixed_chunk=True)
    pending = list(enumerate(prompts))
    while pending or not driver.scheduler.is_idle():
        if pending:
            i, prompt = pending.pop(0)
            driver.submit(f"r{i}", prompt, max_new_tokens=10)
        driver.step()
    assert driver.outputs() == expected
    driver.close()


def test_decode_log_line_every_interval(tiny_llama, caplog):
    driver = driver_for(tiny_llama, True, decode_log_interval=4)
    for i, prompt in enumerate(make_prompts(14, 3, 512, 5, 10)):
        driver.submit(f"r{i}", prompt, max_new_tokens=13)
    with caplog.at_level("INFO", logger="radixserve.scheduler"):
        driver.run_until_idle()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert len(lines) == driver.scheduler.stats.decode_steps // 4 == 3
    for field in ("#running-req: 3", "#queue-req: 0", "token usage:", "cache hit rate:", "gen throughput (token/s):"):
        assert field in lines[0], field
    driver.close()


def test_prefill_log_line_every_prefill_batch(tiny_llama, caplog):
    """One SGLang-style "Prefill batch." line per extend batch, with what the batch computes and reuses."""
    driver = driver_for(tiny_llama, True, chunked_prefill_size=-1, max_prefill_tokens=30)
    prompts = make_prompts(15, 4, 512, 20, 21)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=2)
    with caplog.at_level("INFO", logger="radixserve.scheduler"):
        driver.run_until_idle()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")]
    stats = driver.scheduler.stats
    assert len(lines) == stats.extend_batches + stats.mixed_batches >= 2  # 30 tokens a batch: not all at once
    new_seqs = sum(int(line.split("#new-seq: ")[1].split(",")[0]) for line in lines)
    new_tokens = sum(int(line.split("#new-token: ")[1].split(",")[0]) for line in lines)
    assert new_seqs == len(prompts)
    assert new_tokens == sum(map(len, prompts)) - stats.cached_tokens
    assert "#queue-req: " in lines[0] and "#cached-token: 0" in lines[0]
    driver.close()
