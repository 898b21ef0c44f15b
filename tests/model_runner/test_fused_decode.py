"""Every decoder layer in one C++ call (model_runner/fused_decode.py, kernels/cpu_decode_layers.cpp): on the
embedded SmolLM2's GGUF blocks, batches of a few tokens give the logits of the Python layers bit for bit, and
batches of `DENSE_FROM` tokens or more run the layers; so do tiny Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms)
models whose projections are put on Q8_0 blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from radixserve.kernels import cpu_build
from radixserve.model_runner.fused_decode import FusedDecodeLayers, use_fused_decode_layers
from radixserve.model_runner.cpu.gguf_linear import DENSE_FROM, GGUFLinear
from radixserve.model_runner.loader.gguf_blocks import BlockMatrix
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import greedy_generate
from radixserve.runtime.model_files import load_tokenizer
from radixserve.runtime.wire.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not cpu_build.load(), reason="the C++ CPU kernels do not build here")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
           "1, 1, 2, 3, 5, 8,", "Water boils at", "The quick brown fox", "In 1492, Columbus", "SELECT * FROM",
           "Dear Sir or Madam,"]


def runner_on_blocks(activations: str = "float32", kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", quantization="gguf", gguf_activations=activations, kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=4096, max_running_requests=16)))


def logits_of_each_step(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    steps = []
    forward = runner.forward

    def recording(batch):
        logits = forward(batch)
        steps.append(logits.clone())
        return logits

    runner.forward = recording
    try:
        greedy_generate(runner, prompts, new_tokens)
    finally:
        runner.forward = forward
    return steps


# auto: keys and values in float16; bfloat16: the queries rounded to bfloat16 inside the attention kernel
@pytest.mark.parametrize("activations,kv_cache_dtype", [("float32", "auto"), ("int8", "auto"), ("int8", "bfloat16")])
def test_fused_layers_give_the_python_layers_logits_bit_for_bit(default_model_dir, activations, kv_cache_dtype):
    runner = runner_on_blocks(activations, kv_cache_dtype)
    assert runner.token_to_kv_pool.k_buffer[0].dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16"
                                                          else torch.float16)
    fused = runner.model.model.fused_decode
    assert isinstance(fused, FusedDecodeLayers)
    every_row = torch.ops.radixserve_cpu.gguf_interleaved_vectorized()  # interleaved blocks, either activations
    assert (fused.max_tokens is None) == every_row
    taken = []

    def counting(positions, hidden, batch, attn_backend):
        out = fused(positions, hidden, batch, attn_backend)
        taken.append((hidden.shape[0], out is not None))
        return out

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    for group in (prompts[:1], prompts[1:4], prompts[:DENSE_FROM + 1]):
        taken.clear()
        runner.model.model.fused_decode = counting
        with_fused = logits_of_each_step(runner, group, 12)
        runner.model.model.fused_decode = None
        layers = logits_of_each_step(runner, group, 12)
        assert len(with_fused) == len(layers) == 12
        for step, (a, b) in enumerate(zip(with_fused, layers)):
            assert torch.equal(a, b), f"{len(group)} prompts, step {step}: max diff {(a - b).abs().max().item()}"
        # interleaved blocks: every batch takes the fused call; other blocks: a batch of fewer than DENSE_FROM tokens
        # (a short prompt's prefill too), others not
        assert [tokens for tokens, _ in taken] == [sum(map(len, group))] + [len(group)] * 11
        assert all(took == (fused.max_tokens is None or tokens < DENSE_FROM) for tokens, took in taken)
    runner.model.model.fused_decode = fused


def on_q8_0_blocks(runner: ModelRunner) -> None:
    """Swap each layer's four projections for `GGUFLinear`s on Q8_0 blocks of their float weights (gguf-py's
    quantizer), biases kept."""
    for layer in runner.model.model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            linear = getattr(owner, name)
            weight = linear.weight.detach().float().numpy()
            blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight, GGMLQuantizationType.Q8_0)))
            bias = None if linear.bias is None else linear.bias.detach().float()
            setattr(owner, name, GGUFLinear(BlockMatrix(int(GGMLQuantizationType.Q8_0), blocks, weight.shape[1]), bias))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_layers_on_blocks_give_the_python_layers_logits_bit_for_bit(tiny_model_dir, arch):
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=tiny_model_dir(arch), device="cpu", dtype="float32", max_total_tokens=1024,
        max_running_requests=8)))
    on_q8_0_blocks(runner)
    attn = runner.model.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2") and hasattr(attn, "q_norm") == (arch == "qwen3")
    assert use_fused_decode_layers(runner.model)
    fused = runner.model.model.fused_decode
    prompts = [[int(t) for t in torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 11, 6)]
    taken = []
    runner.model.model.fused_decode = lambda *args: taken.append(fused(*args)) or taken[-1]
    with_fused = logits_of_each_step(runner, prompts, 10)
    # every decode step (3 tokens); the 20-token prefill where the blocks are interleaved
    assert sum(out is not None for out in taken) == (10 if fused.max_tokens is None else 9)
    runner.model.model.fused_decode = None
    layers = logits_of_each_step(runner, prompts, 10)
    runner.model.model.fused_decode = fused
    for step, (a, b) in enumerate(zip(with_fused, layers)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"


def test_models_the_fused_layers_do_not_cover_keep_their_layers(default_model_dir, tiny_model_dir):
    float_path = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", quantization="none", max_total_tokens=1024, max_running_requests=4)))
    assert float_path.model.model.fused_decode is None  # float linears, not blocks
    assert not use_fused_decode_layers(float_path.model)
    qwen = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=tiny_model_dir("qwen3"), device="cpu", max_total_tokens=1024, max_running_requests=4)))
    assert not use_fused_decode_layers(qwen.model)  # not a GGUF, and its layers have q/k norms
