"""--enable-deterministic-inference on the CPU: 16 prompts give bit-identical ids and logprobs alone, inside a batch of
64 with random neighbours, and again after their prefixes are cached, with chunked prefill cutting the long prompts
(model_runner/cpu/dispatch.py: every linear on the small-row kernel; the attention's requests each alone).

Greedy requests: their ids and the logprobs of every output token.
"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
MAX_NEW_TOKENS = 8


def _prompts(count: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


def _params(i: int) -> dict:
    return {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}


def _fingerprint(result: dict) -> tuple:
    logprobs = tuple((entry[0], entry[1]) for entry in result["meta_info"]["output_token_logprobs"])
    return tuple(result["output_ids"]), logprobs


def test_outputs_do_not_depend_on_the_batch_or_the_cache(tiny_model_dir):
    from radixserve import Engine

    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    with Engine(model_path=model_dir, device="cpu", dtype="float32", enable_deterministic_inference=True,
                chunked_prefill_size=32, log_level="warning") as engine:
        vocab = engine.model_info.vocab_size
        prompts = _prompts(16, seed=1, vocab=vocab)
        params = [_params(i) for i in range(16)]

        alone = []
        for prompt, sampling in zip(prompts, params):
            engine.flush_cache()
            alone.append(_fingerprint(engine.generate(input_ids=prompt, sampling_params=sampling,
                                                      return_logprob=True)))

        engine.flush_cache()
        neighbours = _prompts(48, seed=2, vocab=vocab)
        order = list(range(64))
        random.Random(3).shuffle(order)
        batch = [(prompts[i], params[i]) if i < 16 else (neighbours[i - 16], _params(i)) for i in order]
        results = engine.generate(input_ids=[p for p, _ in batch], sampling_params=[s for _, s in batch],
                                  return_logprob=True)
        in_batch = {i: _fingerprint(r) for i, r in zip(order, results) if i < 16}
        assert [in_batch[i] for i in range(16)] == alone

        # Every prompt is cached now; again, alone and in a batch, each computes only its last token.
        again = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)
        assert [_fingerprint(r) for r in again] == alone
        cached_alone = [_fingerprint(engine.generate(input_ids=p, sampling_params=s, return_logprob=True))
                        for p, s in zip(prompts[:4], params[:4])]
        assert cached_alone == alone[:4]
        # A prompt that extends a cached one: the cached part's KV is the same bits as if computed now.
        longer = [p + p[:20] for p in prompts[:4]]
        engine.flush_cache()
        fresh = [_fingerprint(engine.generate(input_ids=p, sampling_params=s, return_logprob=True))
                 for p, s in zip(longer, params[:4])]
        engine.generate(input_ids=prompts[:4], sampling_params=params[:4])
        extended = engine.generate(input_ids=longer, sampling_params=params[:4], return_logprob=True)
        assert [_fingerprint(r) for r in extended] == fresh


def test_deterministic_inference_refusals():
    from radixserve.runtime.wire.server_args import ServerArgs

    with pytest.raises(ValueError, match="cpu-kernels torch"):
        ServerArgs(enable_deterministic_inference=True, cpu_kernels="torch")
    with pytest.raises(ValueError, match="tp_size 1"):
        ServerArgs(enable_deterministic_inference=True, tp_size=2)
    with pytest.raises(ValueError, match="cpu attention backend"):
        ServerArgs(enable_deterministic_inference=True, attention_backend="torch_native")
