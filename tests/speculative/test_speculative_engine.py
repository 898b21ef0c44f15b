"""Speculative decoding end to end on the embedded model (CPU, float32): a real Engine with n-gram drafts gives
Hugging Face's greedy tokens, accepts drafts on text that repeats itself, and reports SGLang's spec_* meta_info
keys and the acceptance in the server info."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Once upon a time",
    "Colors: red, green, blue. Colors: red, green, blue. Colors:",
]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    with Engine(log_level="warning", speculative_algorithm="NGRAM", speculative_num_draft_tokens=5) as engine:
        yield engine


def hf_greedy(model_dir: str, prompts: list[list[int]], eos_ids: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's scheduler process shares the cores
    try:
        outputs = []
        with torch.no_grad():
            for ids in prompts:
                out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     eos_token_id=eos_ids, pad_token_id=eos_ids[0],
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                outputs.append(out[0, len(ids):].tolist())
    finally:
        torch.set_num_threads(threads)
    return outputs


def test_greedy_equals_hugging_face_and_drafts_are_accepted(engine, default_model_dir):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    results = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0})
    expected = hf_greedy(default_model_dir, ids, engine.model_info.eos_token_ids)
    assert [r["output_ids"] for r in results] == expected
    metas = [r["meta_info"] for r in results]
    for meta in metas:
        assert meta["spec_verify_ct"] > 0
        assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert sum(meta["spec_accept_token_num"] for meta in metas) > 0
    # Repeated text is copied: some request needs fewer verify steps than it has tokens after the first.
    assert any(meta["spec_verify_ct"] < meta["completion_tokens"] - 1 for meta in metas), metas
    info = engine.get_server_info()
    assert info["spec_num_accepted_drafts"] >= sum(meta["spec_accept_token_num"] for meta in metas)
    assert 0 < info["spec_accept_rate"] <= 1 and info["avg_spec_accept_length"] > 1


@pytest.mark.slow
def test_sampling_and_abort_leave_no_kv_behind(engine):
    params = {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 3}
    first = engine.generate(PROMPTS[:2], params)
    second = engine.generate(PROMPTS[:2], params)
    # The second run's drafts come from the tree (the first run's outputs); the seeded draws are the same.
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in second]
    info = engine.get_server_info()
    memory = info["memory"]
    assert memory["free_tokens"] + memory["evictable_tokens"] == memory["total_tokens"]
    assert memory["protected_tokens"] == 0
