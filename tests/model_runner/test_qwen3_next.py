"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5's hybrid decoder over Qwen's sparse feed-forward, on the CPU.

A tiny random-weight model built from `Qwen3NextConfig` and saved with `save_pretrained` (tests/conftest.py: 4 layers,
three Gated DeltaNet and the last full; 2 key heads of 4 value heads; 8 experts, top-2, a shared expert, on every
layer but layer 2), so the loader reads the real checkpoint layout:

- the config: the hybrid layout, the sparse layers, the routing, the partial RoPE (a quarter of each head by default);
- the regrouped input projection gives the q, k, v, z, b, a that transformers' layer derives from its per-key-head
  layout;
- greedy ids equal `transformers` generate over 32 tokens for 8 prompts of different lengths, in one batched runner;
- the released model's shape (benchmarks/configs/qwen3-next-80b-a3b.json) builds and takes its dummy weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_hybrid_models import hybrid_references
from test_model_forward import MAX_NEW_TOKENS, hf_model, make_runner

from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.models import get_model_class
from radixserve.model_runner.moe import SparseMoeBlock
from radixserve.model_runner.static_generate import greedy_generate


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_next")


@pytest.fixture(scope="module")
def references(model_dir):
    return hybrid_references(model_dir)


def test_config_reads_the_hybrid_and_sparse_layout(model_dir):
    config = ModelConfig.from_path(model_dir)
    assert config.is_hybrid and config.linear_attention.linear_layers == {0, 1, 2}
    assert config.num_kv_layers == 1 and config.qk_norm and config.rotary_dim == 4
    moe = config.moe
    assert moe.sparse_layers == {0, 1, 3} and (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert moe.routing == "softmax_topk" and moe.renormalize and moe.shared_expert_intermediate_size == 48
    # transformers' defaults where a config.json leaves them out: a quarter of each head rotates, every fourth layer
    # attends fully; `decoder_sparse_step` spaces the sparse layers.
    keys = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 8, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 100, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 2}
    sparse = ModelConfig.from_dict(keys)
    assert sparse.partial_rotary_factor == 0.25 and sparse.linear_attention.linear_layers == {0, 1, 2, 4, 5, 6}
    assert sparse.moe.sparse_layers == {1, 3, 5, 7}


def test_regrouped_projection_equals_transformers_split(model_dir):
    """`in_proj_qkvz` / `in_proj_ba` hold their rows per key head; the loaded `in_proj` gives the same q, k, v, z, b, a
    as transformers' own regrouping (`fix_query_key_value_ordering`)."""
    reference = hf_model(model_dir).model.layers[0].linear_attn
    layer = make_runner(model_dir).model.layers[0].linear_attn
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.fix_query_key_value_ordering(reference.in_proj_qkvz(x), reference.in_proj_ba(x))
        q, k, v, z, b, a = layer.in_proj(x[0]).split(
            [layer.key_size, layer.key_size, layer.value_size, layer.value_size, layer.num_v_heads,
             layer.num_v_heads], dim=-1)
    ours = (q, k, v, z, b, a)
    for name, mine, theirs in zip("qkvzba", ours, expected):
        torch.testing.assert_close(mine, theirs[0].reshape(5, -1), rtol=1e-5, atol=1e-5, msg=name)
    assert not torch.equal(v, reference.in_proj_qkvz(x)[0, :, 64:128])  # the grouped layout is not the flat one


def test_greedy_ids_equal_transformers(model_dir, references):
    prompts, expected = references
    runner = make_runner(model_dir)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.layers] == [True, True, False, True]
    assert runner.token_to_kv_pool.num_layers == 1 and runner.state_pool.num_layers == 3
    outputs = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(outputs)  # not a degenerate comparison
    assert runner.allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


def test_dummy_weights_fill_every_parameter(model_dir):
    runner = make_runner(model_dir, load_format="dummy")
    assert len(greedy_generate(runner, [[1, 2, 3]], 4)[0]) == 4
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())


def test_checkpoint_errors_name_the_tensor(model_dir):
    runner = make_runner(model_dir, load_format="dummy")
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        runner.model.load_weights([("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(100, 64))], False)
    with pytest.raises(ValueError, match="no matching parameter"):  # layer 3 attends fully
        runner.model.load_weights([("model.layers.3.linear_attn.in_proj_ba.weight", torch.zeros(8, 64))], False)
    with pytest.raises(ValueError, match="names expert 8 of 8"):
        runner.model.load_weights([("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))], False)
    with pytest.raises(ValueError, match="no matching parameter"):  # layer 2 is dense
        runner.model.load_weights([("model.layers.2.mlp.experts.0.up_proj.weight", torch.zeros(32, 64))], False)
    # The released checkpoints carry a multi-token-prediction head; it is passed over, as transformers does.
    runner.model.load_weights([("mtp.fc.weight", torch.zeros(64, 128))], False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_ids_equal_transformers_on_cuda(model_dir, references):
    """The same 8 prompts on a CUDA device in float32: flash-linear-attention's kernels (where they import) for the
    linear layers, the fused MoE Triton kernel for the experts, Triton attention for the full layer."""
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.runtime.wire.server_args import ServerArgs

    prompts, expected = references
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=model_dir, device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=4096,
        max_running_requests=16)))
    assert greedy_generate(runner, prompts, MAX_NEW_TOKENS) == expected


def test_qwen3_next_80b_benchmark_config_builds_and_takes_its_dummy_weights():
    """The released shape (benchmarks/configs/qwen3-next-80b-a3b.json): 36 linear and 12 full-attention layers, 512
    experts on each, and its dummy weights fill every parameter (meta device): about 80B parameters."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-next-80b-a3b.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    assert len(config.linear_attention.linear_layers) == 36 and config.num_kv_layers == 12
    assert len(config.moe.sparse_layers) == 48 and config.rotary_dim == 64
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64)
        model.load_weights((name, torch.empty(shape)) for name, shape in model.hf_weight_shapes().items())
    total = sum(p.numel() for p in model.parameters())
    assert 79e9 < total < 82e9, total
