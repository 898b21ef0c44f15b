"""gpt-oss (`GptOssForCausalLM`) served on the CPU against Hugging Face.

A tiny random-weight model from transformers' `GptOssConfig`, saved with `save_pretrained` (tests/conftest.py: 2
layers, sliding then full, windows of 8 positions, shorter than most prompts; YaRN RoPE; 8 experts top-2 with biases;
a SwiGLU limit of 1 so the clamps engage):

- the config: experts, routing, activation, windows and RoPE read from gpt-oss's keys;
- greedy ids equal `transformers` generate over 32 tokens for 8 prompts, with the torch_native and the CPU kernel
  attention backends; the sinks matter (HF with them turned off gives other ids);
- through a real scheduler: chunked prefill of 16, mixed prefill/decode batches and radix-cache hits keep the ids;
- MXFP4 checkpoints: test_gpt_oss_mxfp4.py;
- tensor parallelism (2 ranks, each half of every expert and of the heads' sinks) and expert parallelism (`--ep-size
  2`, four whole experts each) give the ids of one rank;
- benchmarks/configs/gpt-oss-20b.json builds, and its dummy weights fill every parameter (on the meta device).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, make_runner, random_prompts
from test_moe_models import SCHEDULER_CONFIGS, check_batches_and_radix_hits

from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.static_generate import greedy_generate

PROMPT_LENGTHS = [3, 17, 8, 1, 25, 12, 5, 30]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gpt_oss")


@pytest.fixture(scope="module")
def prompts():
    head = random_prompts(512, [20], seed=11)[0]  # a shared head on some prompts, so the tree shares prefixes
    return [head + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(512, PROMPT_LENGTHS, seed=5))]


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    reference = hf_model(model_dir)
    return [hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]


def test_config_is_read(model_dir):
    config = ModelConfig.from_path(model_dir)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.routing) == (8, 2, 32, "topk_softmax")
    assert moe.bias and (moe.activation.kind, moe.activation.alpha, moe.activation.limit) == ("clamped_swiglu",
                                                                                              1.702, 1.0)
    assert moe.sparse_layers == {0, 1}
    assert config.layer_windows == (8, None) and config.attention_bias
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 50000.0


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_greedy_ids_equal_transformers(model_dir, prompts, expected, backend):
    runner = make_runner(model_dir, attention_backend=backend)
    assert greedy_generate(runner, prompts, MAX_NEW_TOKENS) == expected
    assert len({tuple(ids) for ids in expected}) == len(expected)  # not a degenerate comparison
    assert runner.allocator.available_size() == runner.max_total_num_tokens


def test_sinks_change_the_output(model_dir, prompts, expected):
    """Hugging Face without the sinks (a logit of -1e4 takes no mass) generates other ids: the equality above
    depends on them."""
    reference = hf_model(model_dir)
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert [hf_greedy(reference, p, 8, []) for p in prompts[:3]] != [ids[:8] for ids in expected[:3]]


def test_rms_norm_rounds_as_transformers_in_bfloat16():
    """gpt-oss's norm multiplies by its (float32-kept) weight before rounding: bit-equal to transformers' in bfloat16,
    residual add included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm as HFNorm

    from radixserve.model_runner.models.gpt_oss import GptOssRMSNorm

    generator = torch.Generator().manual_seed(0)
    weight = (1 + 0.3 * torch.randn(64, generator=generator)).bfloat16()  # as a checkpoint stores it
    x, residual = (torch.randn(9, 64, generator=generator).bfloat16() for _ in range(2))
    ours, theirs = GptOssRMSNorm(64, 1e-5).bfloat16(), HFNorm(64, eps=1e-5)  # transformers keeps it in float32
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight.float())
        out, summed = ours(x, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(out, theirs(residual + x))
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
def test_scheduler_batches_and_radix_hits_keep_the_ids(model_dir, prompts, expected, config):
    check_batches_and_radix_hits(model_dir, prompts, expected, config)


def _gpu_runner(model_dir: str, backend: str, dtype: str):
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.runtime.wire.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, device="cuda", dtype=dtype, attention_backend=backend,
                      max_total_tokens=4096, max_running_requests=16)
    return ModelRunner(RunnerConfig.from_server_args(args))


def _transformers_reads_the_swiglu_limit(model_dir: str) -> bool:
    """Whether the installed transformers clamps by the config's `swiglu_limit` (older releases fix it at 7.0 and
    `swiglu_alpha` at 1.702, so on the tiny model's limit of 1 their ids are another model's)."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = AutoConfig.from_pretrained(model_dir)
    return GptOssExperts(config).limit == config.swiglu_limit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_triton_float32_greedy_ids_equal_the_cpu_path(model_dir, prompts, expected):
    """On a GPU, float32 end to end (IEEE products): the fused Triton experts (biases, clamped SwiGLU) and the Triton
    attention's sinks in the whole model, decode in CUDA graphs, give the CPU path's ids, which the tests above hold
    to transformers' (and transformers' own here, where the installed release reads the config's SwiGLU limit)."""
    cpu = greedy_generate(make_runner(model_dir, attention_backend="torch_native"), prompts, MAX_NEW_TOKENS)
    assert greedy_generate(_gpu_runner(model_dir, "triton", "float32"), prompts, MAX_NEW_TOKENS) == cpu
    if _transformers_reads_the_swiglu_limit(model_dir):
        assert cpu == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_flashinfer_bfloat16_agrees_with_torch_native(tiny_model_dir, prompts):
    """FlashInfer runs 16-bit only: in bfloat16 its sinks give the ids torch_native's give on the same GPU (the rest of
    the model is the same code), allowing one prompt whose near tie bfloat16 may flip. The model takes gpt-oss's head
    size of 64: FlashInfer has no kernels for the tiny default's 16."""
    pytest.importorskip("flashinfer")
    model_dir = tiny_model_dir("gpt_oss", head_dim=64)
    ours = greedy_generate(_gpu_runner(model_dir, "flashinfer", "bfloat16"), prompts, 8)
    native = greedy_generate(_gpu_runner(model_dir, "torch_native", "bfloat16"), prompts, 8)
    assert sum(a == b for a, b in zip(ours, native)) >= len(prompts) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_default_backend_decodes_the_windows_in_cuda_graphs(tiny_model_dir):
    """With no attention backend asked, a model with sliding windows takes the triton backend, whose decode graphs
    apply the windows; flashinfer's do not, so asked for by name it decodes eagerly."""
    pytest.importorskip("flashinfer")
    model_dir = tiny_model_dir("gpt_oss", head_dim=64)
    default = _gpu_runner(model_dir, None, "bfloat16")
    assert type(default.attn_backend).__name__ == "TritonAttentionBackend"
    assert default.cuda_graph_runner is not None
    asked = _gpu_runner(model_dir, "flashinfer", "bfloat16")
    assert type(asked.attn_backend).__name__ == "FlashInferAttentionBackend" and asked.cuda_graph_runner is None


# ---- parallelism ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ep_size", [1, 2])
def test_two_ranks_equal_one(model_dir, prompts, expected, ep_size):
    """`--tp-size 2`: each gloo rank holds half of every expert (the down bias on the first rank only) and of the
    heads with their sinks; with `--ep-size 2`, four whole experts each."""
    from test_tensor_parallel import _run_group

    [ids] = _run_group(2, [model_dir], prompts=prompts, max_new_tokens=MAX_NEW_TOKENS, ep_size=ep_size)
    assert ids == expected


# ---- the benchmark config ------------------------------------------------------------------------

def test_gpt_oss_20b_benchmark_config_builds_and_takes_its_dummy_weights():
    """The published config (benchmarks/configs/gpt-oss-20b.json): read as gpt-oss, and its dummy weights (the
    checkpoint's names and 16-bit shapes) fill every parameter, checked on the meta device."""
    from radixserve.model_runner.loader.weights import dummy_weight_shapes
    from radixserve.model_runner.models import get_model_class

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "gpt-oss-20b.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (32, 4, 2880)
    assert config.layer_windows == (128, None) * 12 and config.head_dim == 64
    assert config.rope_scaling["factor"] == 32.0 and config.rope_scaling["original_max_position_embeddings"] == 4096
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64)
        model.load_weights((name, torch.empty(shape)) for name, shape in dummy_weight_shapes(config).items())
    total = sum(p.numel() for p in model.parameters())
    assert 20.5e9 < total < 21.5e9  # "20b": 20.9B parameters
    # 3.6B active, as published: 4 of 32 experts a layer, the unembedding but not the embedding lookup.
    active = total - 24 * (32 - 4) * (3 * 2880 * 2880 + 3 * 2880) - 201088 * 2880
    assert 3.5e9 < active < 3.7e9
    assert math.isclose(model.model.layers[0].self_attn.scaling, 64 ** -0.5)
