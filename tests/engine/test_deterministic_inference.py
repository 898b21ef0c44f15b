"""--enable-deterministic-inference on the CPU: 16 prompts give bit-identical ids and logprobs alone and inside a batch
of 64 with random neighbours (model_runner/cpu/dispatch.py: every linear on the small-row kernel; the attention's
requests each alone, every query row as a decode row), after cache hits, and with prefill chunks of another size.

Greedy and seeded sampled requests (top-p, top-k, min-p): their ids and the logprobs of every output token.
"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.timeout(900)]
MAX_NEW_TOKENS = 8


def _prompts(count: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


def _params(i: int) -> dict:
    """Greedy for even i; odd i sample with a seed through top-p, top-k and min-p filters in turn."""
    if i % 2 == 0:
        return {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}
    filters = ({"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05, "top_p": 0.95})[i // 2 % 3]
    return {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.9, "seed": 1000 + i, **filters}


def _fingerprint(result: dict) -> tuple:
    logprobs = tuple((entry[0], entry[1]) for entry in result["meta_info"]["output_token_logprobs"])
    return tuple(result["output_ids"]), logprobs


def _engine(tiny_model_dir, chunked_prefill_size: int):
    from radixserve import Engine

    return Engine(model_path=tiny_model_dir("llama", with_tokenizer=True), device="cpu", dtype="float32",
                  enable_deterministic_inference=True, chunked_prefill_size=chunked_prefill_size, log_level="warning")


def _alone(engine, prompts, params) -> list[tuple]:
    out = []
    for prompt, sampling in zip(prompts, params):
        engine.flush_cache()
        out.append(_fingerprint(engine.generate(input_ids=prompt, sampling_params=sampling, return_logprob=True)))
    return out


def test_outputs_do_not_depend_on_the_batch(tiny_model_dir):
    """16 prompts alone, then shuffled into a batch of 64 with random neighbours: the same ids and logprobs."""
    with _engine(tiny_model_dir, chunked_prefill_size=4096) as engine:
        vocab = engine.model_info.vocab_size
        prompts = _prompts(16, seed=1, vocab=vocab)
        params = [_params(i) for i in range(16)]
        alone = _alone(engine, prompts, params)

        engine.flush_cache()
        neighbours = _prompts(48, seed=2, vocab=vocab)
        order = list(range(64))
        random.Random(3).shuffle(order)
        batch = [(prompts[i], params[i]) if i < 16 else (neighbours[i - 16], _params(i)) for i in order]
        results = engine.generate(input_ids=[p for p, _ in batch], sampling_params=[s for _, s in batch],
                                  return_logprob=True)
        assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
        in_batch = {i: _fingerprint(r) for i, r in zip(order, results) if i < 16}
        assert [in_batch[i] for i in range(16)] == alone


@pytest.mark.slow
def test_outputs_do_not_depend_on_the_cache_or_chunking(tiny_model_dir):
    with _engine(tiny_model_dir, chunked_prefill_size=32) as engine:
        prompts = _prompts(16, seed=1, vocab=engine.model_info.vocab_size)
        params = [_params(i) for i in range(16)]
        alone = _alone(engine, prompts, params)
        engine.flush_cache()
        engine.generate(input_ids=prompts, sampling_params=params)
        again = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)
        assert [_fingerprint(r) for r in again] == alone
    # Prefill chunks of another size (and most prompts in one chunk): the same bits.
    with _engine(tiny_model_dir, chunked_prefill_size=8) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert [_fingerprint(r) for r in results] == alone


def test_deterministic_inference_refusals():
    from radixserve.runtime.wire.server_args import ServerArgs

    with pytest.raises(ValueError, match="cpu-kernels torch"):
        ServerArgs(enable_deterministic_inference=True, cpu_kernels="torch")
    with pytest.raises(ValueError, match="tp_size 1"):
        ServerArgs(enable_deterministic_inference=True, tp_size=2)
    with pytest.raises(ValueError, match="cpu attention backend"):
        ServerArgs(enable_deterministic_inference=True, attention_backend="torch_native")
