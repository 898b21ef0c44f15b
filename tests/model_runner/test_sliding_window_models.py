"""Sliding-window hybrid families (Gemma 3) served on the CPU against Hugging Face.

A tiny random-weight Gemma 3 built from `Gemma3TextConfig` and saved with `save_pretrained` (tests/conftest.py):
4 layers, three of them sliding with a window of 8 positions, shorter than most prompts here, the full layer with its
own RoPE base, soft-capped logits. Greedy ids equal `transformers` generate over 32 tokens for 8 prompts, in one
batched runner on each CPU attention backend; through a real scheduler, chunked prefill of 16, radix-cache hits (cache
on and off) and a retraction mid-decode give the same ids.
"""

from __future__ import annotations

import pytest

from scheduler_driver import SchedulerDriver
from test_model_forward import MAX_NEW_TOKENS, assert_same_greedy_tokens, hf_greedy, hf_model, random_prompts

from radixserve.model_runner.model_config import ModelConfig

FAMILIES = ["gemma3", "gemma4"]
PROMPT_LENGTHS = [3, 17, 8, 1, 25, 12, 5, 30]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir):
    return {family: tiny_model_dir(family) for family in FAMILIES}


def make_prompts() -> list[list[int]]:
    """8 prompts of 1 to 50 tokens, a shared 20-token head on some, so the tree shares prefixes."""
    head = random_prompts(512, [20], seed=11)[0]
    return [head + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(512, PROMPT_LENGTHS, seed=5))]


@pytest.fixture(scope="module")
def references(model_dirs):
    """Each family's prompts and HF's greedy ids."""
    built = {}

    def get(family: str) -> tuple[list[list[int]], list[list[int]]]:
        if family not in built:
            prompts = make_prompts()
            reference = hf_model(model_dirs[family])
            built[family] = prompts, [hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]
        return built[family]

    return get


def test_gemma3_config_is_read(model_dirs):
    config = ModelConfig.from_path(model_dirs["gemma3"])
    assert config.layer_windows == (8, 8, None, 8) and config.sliding_windows == (8,)
    assert (config.rope_theta, config.sliding_rope_theta) == (50000.0, 10000.0)
    assert config.qk_norm and config.tie_word_embeddings


def test_windows_follow_layer_types_or_fill_every_layer():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 100}
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    assert mistral.layer_windows == (16,) * 4
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                                   "use_sliding_window": True,
                                   "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2})
    assert qwen2.layer_windows == (None, None, 16, 16) and qwen2.window_of(0) is None
    assert ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}).layer_windows == ()
    gemma = ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                   "num_hidden_layers": 7, "sliding_window": 4, "sliding_window_pattern": 3})
    assert gemma.layer_windows == (4, 4, None, 4, 4, None, 4)
    with pytest.raises(ValueError, match="layer_types names 3 layers"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                               "use_sliding_window": True, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "relu"})


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_equal_transformers(family, backend, model_dirs, references):
    prompts, expected = references(family)
    assert max(len(p) for p in prompts) > 8  # the window matters
    outputs = assert_same_greedy_tokens(model_dirs[family], prompts, attention_backend=backend)
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(outputs)  # not a degenerate comparison


SCHEDULER_CONFIGS = {
    "chunk-16": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    "mixed-chunk-overlap": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=False),
    "no-cache": dict(chunked_prefill_size=16, disable_radix_cache=True),
}


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_scheduler_chunks_and_radix_hits_keep_the_ids(family, config, model_dirs, references):
    prompts, expected = references(family)
    driver = SchedulerDriver(model_dirs[family], max_total_tokens=4096, **SCHEDULER_CONFIGS[config])
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.outputs() == expected
    assert driver.scheduler.stats.partial_chunks > 0
    # The same prompts again: with the cache, all but the last token of each is a hit; the ids do not change.
    for i, prompt in enumerate(prompts):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    again = [driver.results[f"again{i}"] for i in range(len(prompts))]
    assert [r.output_ids for r in again] == expected
    hits = [r.cached_tokens for r in again]
    assert hits == ([0] * len(prompts) if "no-cache" in config else [len(p) - 1 for p in prompts])
    driver.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_retraction_mid_decode_keeps_the_ids(family, model_dirs, references):
    """A pool too small for every request's whole output: admission's optimism runs out mid-decode, requests are
    retracted and re-run, and their ids do not change."""
    prompts, expected = references(family)
    driver = SchedulerDriver(model_dirs[family], max_total_tokens=200, disable_overlap_schedule=True)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.scheduler.stats.num_retractions > 0
    assert driver.outputs() == expected
    driver.close()


def test_gemma4_config_is_read(tiny_model_dir):
    config = ModelConfig.from_path(tiny_model_dir("gemma4"))
    assert config.layer_windows == (8, 8, None, 8, 8, None)
    assert config.layer_kv_shapes == ((2, 16), (2, 16), (1, 32), (2, 16), (2, 16), (1, 32))
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    base = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
            "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    assert ModelConfig.from_dict(base).layer_kv_shapes == ((4, 16), (4, 512))  # transformers' default global_head_dim
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelConfig.from_dict({**base, "enable_moe_block": True})


def test_gemma3_4b_benchmark_config_takes_its_dummy_weights():
    """The config the GPU check runs (benchmarks/configs/gemma-3-4b.json): five sliding layers to one full, the
    full layers' linear RoPE scaling, and dummy weights (checkpoint names and shapes) that fill every parameter of the
    model, checked on the meta device."""
    import json
    from pathlib import Path

    import torch

    from radixserve.model_runner.loader.weights import dummy_weight_shapes
    from radixserve.model_runner.models import get_model_class

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "gemma-3-4b.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    assert config.layer_windows.count(None) == 5 and config.sliding_windows == (1024,)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.sliding_rope_theta == 10000.0
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64)
        model.load_weights((name, torch.empty(shape)) for name, shape in dummy_weight_shapes(config).items())
    total = sum(p.numel() for p in model.parameters())
    assert 3.8e9 < total < 4.0e9  # "4B" with its vision tower left out


@pytest.mark.parametrize("family,overrides", [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
], ids=["mistral", "qwen2"])
def test_mistral_and_qwen2_windows_are_applied_not_capped(family, overrides, tiny_model_dir):
    """Windows of 8 positions, shorter than the prompts: the context is no longer capped at the window, and the ids
    still equal transformers' (Qwen2's window on its second layer only)."""
    model_dir = tiny_model_dir(family, **overrides)
    config = ModelConfig.from_path(model_dir)
    assert config.layer_windows == ((8, 8) if family == "mistral" else (None, 8))
    prompts = make_prompts()
    reference = hf_model(model_dir)
    expected = [hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]
    outputs = assert_same_greedy_tokens(model_dir, prompts, on_runner=_assert_context_past_the_window)
    assert outputs == expected


def _assert_context_past_the_window(runner) -> None:
    assert runner.context_len == 512  # the tiny models' max_position_embeddings, not the window
