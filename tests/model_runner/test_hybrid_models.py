"""Hybrid linear-attention models (Qwen3.5: Gated DeltaNet layers and gated full attention) on the CPU.

A tiny random-weight Qwen3.5 text model built from `Qwen3_5TextConfig` and saved with `save_pretrained`
(tests/conftest.py: 4 layers, three linear and the last full; 2 key heads of 4 value heads), so the loader reads the
real checkpoint layout:

- the config: which layers are linear, the conv kernel, the linear heads, the partial RoPE;
- greedy ids equal `transformers` generate over 32 tokens for 8 prompts of different lengths, in one batched runner
  (prefill in the chunked form of the gated delta rule, decode in the recurrent form, states in the state pool);
- only the full-attention layers have KV, and the state pool is counted beside it.
"""

from __future__ import annotations

import pytest
import torch

from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, make_runner, random_prompts

from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.static_generate import greedy_generate

PROMPT_LENGTHS = [3, 17, 8, 1, 70, 12, 5, 30]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_5")


def hybrid_references(model_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (a shared 20-token head on some) and Hugging Face's greedy ids for them."""
    head = random_prompts(512, [20], seed=11)[0]
    prompts = [head + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(512, PROMPT_LENGTHS, seed=5))]
    reference = hf_model(model_dir)
    return prompts, [hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]


@pytest.fixture(scope="module")
def references(model_dir):
    return hybrid_references(model_dir)


def test_config_reads_the_hybrid_layout(model_dir):
    config = ModelConfig.from_path(model_dir)
    linear = config.linear_attention
    assert config.is_hybrid and linear.linear_layers == {0, 1, 2}
    assert (linear.conv_kernel_size, linear.num_key_heads, linear.num_value_heads) == (4, 2, 4)
    assert (linear.key_head_dim, linear.value_head_dim, linear.conv_dim) == (16, 16, 2 * 32 + 64)
    assert config.num_kv_layers == 1 and config.kv_layer_id(3) == 0
    assert config.partial_rotary_factor == 0.25 and config.rotary_dim == 4 and config.qk_norm
    interval = ModelConfig.from_dict({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64,
                                      "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                                      "vocab_size": 100, "full_attention_interval": 2})
    assert interval.linear_attention.linear_layers == {0, 2, 4, 6}
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig.from_dict({**config.hf_config, "linear_num_key_heads": 3})


def test_greedy_ids_equal_transformers(model_dir, references):
    prompts, expected = references
    runner = make_runner(model_dir)
    assert runner.token_to_kv_pool.num_layers == 1  # KV for the one full-attention layer only
    assert runner.state_pool is not None and runner.state_pool.num_layers == 3
    outputs = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(outputs)  # not a degenerate comparison
    assert runner.allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


def test_one_request_at_a_time_equals_the_batch(model_dir, references):
    prompts, expected = references
    runner = make_runner(model_dir)
    for prompt, ids in list(zip(prompts, expected))[:3]:
        assert greedy_generate(runner, [prompt], MAX_NEW_TOKENS) == [ids]


def test_dummy_weights_fill_every_parameter(model_dir):
    runner = make_runner(model_dir, load_format="dummy")
    assert greedy_generate(runner, [[1, 2, 3]], 4)[0].__len__() == 4
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())


def test_qwen3_5_9b_benchmark_config_builds_and_takes_its_dummy_weights():
    """The shape the GPU benchmark runs (benchmarks/configs/qwen3.5-9b.json, transformers' Qwen3.5 defaults): read as
    a hybrid of 24 linear and 8 full-attention layers, and its dummy weights fill every parameter (meta device)."""
    import json
    from pathlib import Path

    from radixserve.model_runner.models import get_model_class

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3.5-9b.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    assert len(config.linear_attention.linear_layers) == 24 and config.num_kv_layers == 8
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64)
        model.load_weights((name, torch.empty(shape)) for name, shape in model.hf_weight_shapes().items())
    total = sum(p.numel() for p in model.parameters())
    assert 8.5e9 < total < 10.5e9, total
