"""FP8 and 4-bit checkpoints (model_runner/quantization/) against Hugging Face on their dequantized weights.

Each checkpoint is made at test time from one tiny random Llama (tests/model_runner/quant_checkpoints.py): the
compressed-tensors ones by the package itself, AWQ, GPTQ and Hugging Face's fine-grained FP8 from the published
layouts. Weight-only formats (W4A16) multiply the dequantized weights, so 16 prompts give Hugging Face's 32 greedy ids
on at least 15. FP8 formats also round the activations to FP8: against a reference that rounds each projection's input
the same way, the log-probabilities agree closely, though the greedy ids of a few prompts part where an input sits on
a rounding boundary that float32 reduction order tips (a 6% step for one element); against 16-bit activations they
report the agreement and the mean absolute log-probability distance, with loose bounds.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.quantization import QuantizedLinear
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.static_generate import assign_kv_slots, greedy_generate, make_forward_batch
from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, make_runner, random_prompts
from quant_checkpoints import (TINY_QUANT_LLAMA, compressed_tensors_checkpoint, hf_fp8_block_checkpoint,
                               experts_checkpoint, int4_checkpoint, quantize_projection_inputs,
                               scaled_projections)

NUM_PROMPTS = 16


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return tiny_model_dir("llama", **TINY_QUANT_LLAMA)


@pytest.mark.slow
def test_projection_biases_and_tied_embeddings_load_beside_4bit_weights(tmp_path_factory, tiny_model_dir):
    base = tiny_model_dir("qwen2", **TINY_QUANT_LLAMA)  # q/k/v biases, embeddings tied to the LM head
    model_dir, reference_dir = make_checkpoint(tmp_path_factory, base, "gptq-act-order")
    agree, runner = greedy_agreement(model_dir, reference_dir)
    assert runner.model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert agree >= 15, f"{agree} of {NUM_PROMPTS} prompts give Hugging Face's greedy ids"


def test_online_fp8_quantizes_attention_and_shared_experts_of_a_mixture_of_experts(tiny_model_dir):
    runner = make_runner(tiny_model_dir("qwen2_moe"), quantization="fp8")
    quantized = {name.split(".", 3)[-1] for name, m in runner.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_expert.gate_up_proj",
                         "mlp.shared_expert.down_proj"}
    prompts = random_prompts(runner.vocab_size, [6, 9], seed=4)
    assert all(len(tokens) == 4 for tokens in greedy_generate(runner, prompts, 4))


def make_checkpoint(tmp_path_factory, base_dir: str, fmt: str) -> tuple[str, str]:
    out = str(tmp_path_factory.mktemp(f"q-{fmt}"))
    reference = str(tmp_path_factory.mktemp(f"ref-{fmt}"))
    if fmt.startswith("ct-"):
        compressed_tensors_checkpoint(base_dir, out, reference, fmt[3:])
    elif fmt == "hf-fp8-block":
        hf_fp8_block_checkpoint(base_dir, out, reference)
    else:
        int4_checkpoint(base_dir, out, reference, fmt.split("-")[0], act_order=fmt.endswith("act-order"))
    return out, reference


def greedy_agreement(model_dir: str, reference_dir: str, **runner_kwargs) -> tuple[int, "object"]:
    runner = make_runner(model_dir, **runner_kwargs)
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5 + 3 * i for i in range(NUM_PROMPTS)], seed=1)
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    reference = hf_model(reference_dir)
    agree = sum(tokens == hf_greedy(reference, prompt, MAX_NEW_TOKENS, []) for prompt, tokens in zip(prompts, ours))
    return agree, runner


def logprob_distance(runner, reference) -> float:
    """Mean |log p_ours - log p_reference| over the vocabulary at every position of a 64-token prompt (`reference`:
    a Hugging Face model or its directory)."""
    prompt = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [64], seed=2)[0]
    reference = hf_model(reference) if isinstance(reference, str) else reference
    with torch.inference_mode():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    ours = torch.log_softmax(prompt_logits(runner, prompt), -1)
    return float((ours - expected).abs().mean())


def prompt_logits(runner, prompt: list[int]) -> torch.Tensor:
    """The runner's logits `[len(prompt), vocab]` at every position of one extend."""
    row = runner.req_to_token_pool.alloc()
    slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, [row], [0], [len(prompt)])
    try:
        batch = make_forward_batch(ForwardMode.EXTEND, [row], [0], [prompt], slots, runner.req_to_token_pool,
                                   runner.token_to_kv_pool, logits_indices=torch.arange(len(prompt)))
        return runner.forward(batch).float()
    finally:
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ct-w4a16", "ct-w4a16-asym", "awq", "gptq", "gptq-act-order"])
def test_weight_only_4bit_checkpoints_give_hugging_faces_greedy_ids(tmp_path_factory, base_dir, fmt):
    model_dir, reference_dir = make_checkpoint(tmp_path_factory, base_dir, fmt)
    agree, runner = greedy_agreement(model_dir, reference_dir)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * TINY_QUANT_LLAMA.get("num_hidden_layers", 2)
    assert not any(p.dim() == 2 for name, p in runner.model.named_parameters() if "layers." in name)
    assert agree >= 15, f"{fmt}: {agree} of {NUM_PROMPTS} prompts give Hugging Face's greedy ids"


@pytest.fixture(scope="module")
def fp8_base_dir(base_dir, tmp_path_factory):
    return scaled_projections(base_dir, str(tmp_path_factory.mktemp("fp8-base")), 0.25)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "hf-fp8-block"])
def test_fp8_checkpoints_match_w8a8_arithmetic_and_stay_close_to_hugging_face(tmp_path_factory, fp8_base_dir, fmt):
    """Against Hugging Face on the dequantized weights with each projection's input rounded to FP8 as the format
    defines it (per token; per token and 128 features for Hugging Face's block format): nearly the same. Against
    the dequantized weights alone: the agreement and the log-probability distance that quantizing activations costs."""
    model_dir, reference_dir = make_checkpoint(tmp_path_factory, fp8_base_dir, fmt)
    runner = make_runner(model_dir)
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5 + 3 * i for i in range(NUM_PROMPTS)], seed=1)
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    w8a8 = quantize_projection_inputs(hf_model(reference_dir), 128 if fmt == "hf-fp8-block" else None)
    agree_w8a8 = sum(tokens == hf_greedy(w8a8, p, MAX_NEW_TOKENS, []) for p, tokens in zip(prompts, ours))
    weights_only = hf_model(reference_dir)
    agree = sum(tokens == hf_greedy(weights_only, p, MAX_NEW_TOKENS, []) for p, tokens in zip(prompts, ours))
    distance_w8a8, distance = logprob_distance(runner, w8a8), logprob_distance(runner, weights_only)
    print(f"{fmt}: W8A8 reference {agree_w8a8}/{NUM_PROMPTS} greedy agree (logprob distance {distance_w8a8:.4f}); "
          f"16-bit activations {agree}/{NUM_PROMPTS} (logprob distance {distance:.4f})")
    assert agree_w8a8 >= 12 and distance_w8a8 < 0.05, (agree_w8a8, distance_w8a8)
    assert distance < 0.3, distance


def fp8_reference(weight: torch.Tensor, per_tensor: bool) -> torch.Tensor:
    """float64 FP8 e4m3 round trip with scale = amax / 448 per output channel or per tensor, written independently of
    fp8.py."""
    amax = weight.double().abs().amax() if per_tensor else weight.double().abs().amax(dim=1, keepdim=True)
    scale = amax / 448.0
    return (weight.double() / scale).to(torch.float8_e4m3fn).double() * scale


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["fp8", "w8a8_fp8"])
def test_online_fp8_quantizes_a_16_bit_checkpoint(fp8_base_dir, flag):
    """`fp8`: one scale per weight (each of q/k/v and gate/up its own), activations per call; `w8a8_fp8`: per output
    channel, activations per token, as SGLang names them."""
    from safetensors.torch import load_file

    per_tensor = flag == "fp8"
    runner = make_runner(fp8_base_dir, quantization=flag)
    layers = runner.model.model.layers[1]
    assert isinstance(layers.self_attn.qkv_proj, QuantizedLinear)
    assert layers.self_attn.qkv_proj.weight_value.weight.dtype == torch.float8_e4m3fn
    assert (layers.mlp.down_proj.tensor_scale is not None) == per_tensor  # a per-tensor product on CUDA
    checkpoint = load_file(f"{fp8_base_dir}/model.safetensors")
    parts = [checkpoint[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    torch.testing.assert_close(layers.self_attn.qkv_proj.weight_value.dequantize().double(),
                               torch.cat([fp8_reference(p, per_tensor) for p in parts]), rtol=1e-6, atol=1e-9)

    reference = hf_model(fp8_base_dir)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name.endswith("_proj"):
                module.weight.copy_(fp8_reference(module.weight, per_tensor))
    quantize_projection_inputs(reference, "tensor" if per_tensor else None)
    distance = logprob_distance(runner, reference)  # one prompt alone: the same tensor as Hugging Face's
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5 + 3 * i for i in range(NUM_PROMPTS)], seed=1)
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    agree = sum(tokens == hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p, tokens in zip(prompts, ours))
    print(f"online {flag}: W8A8 reference {agree}/{NUM_PROMPTS} greedy agree (logprob distance {distance:.4f}); "
          f"16-bit model: logprob distance {logprob_distance(runner, fp8_base_dir):.4f}")
    assert distance < 0.05, distance
    if not per_tensor:  # per-tensor activation scales depend on the whole batch, which differs from Hugging Face's
        assert agree >= 12, agree


@pytest.mark.parametrize("flag", [None, "gptq", "gptq_marlin"])
def test_random_weights_load_in_a_checkpoints_quantized_layout(tmp_path, base_dir, flag):
    """A GPTQ layout from the checkpoint's config alone, or with SGLang's flags for it: `gptq_marlin` (Marlin's
    kernels in SGLang) reads as `gptq`, the same weights and function on radixserve's W4A16 kernels."""
    import json
    import shutil

    model_dir = tmp_path / "dummy-w4a16"
    model_dir.mkdir()
    shutil.copy(f"{base_dir}/config.json", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                     "sym": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    runner = make_runner(str(model_dir), load_format="dummy", quantization=flag)
    layer = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.weight_value.qweight.dtype == torch.int32
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [7, 9], seed=3)
    assert all(len(tokens) == 4 for tokens in greedy_generate(runner, prompts, 4))


@pytest.mark.parametrize("fmt", ["hf-fp8", "gptq"])
def test_quantized_experts_of_a_mixture_of_experts_load_dequantized(tmp_path_factory, tiny_model_dir, fmt):
    """A Qwen3-MoE checkpoint whose experts are quantized (fine-grained FP8 as Qwen3-30B-A3B-FP8 ships them, or GPTQ
    with the attention too): the experts load as their dequantized values, the attention as the format's linears (or
    as stored, where the FP8 checkpoint leaves it out), and the model gives Hugging Face's greedy ids on the
    dequantized checkpoint."""
    from safetensors.torch import load_file

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=128)
    out, reference = str(tmp_path_factory.mktemp(f"q-moe-{fmt}")), str(tmp_path_factory.mktemp(f"ref-moe-{fmt}"))
    experts_checkpoint(base, out, reference, fmt)
    runner = make_runner(out)
    converted = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(converted) == (0 if fmt == "hf-fp8" else 2 * TINY_QUANT_LLAMA.get("num_hidden_layers", 2))
    expected = load_file(f"{reference}/model.safetensors")
    experts = runner.model.model.layers[1].mlp.experts
    for e in (0, 5):
        gate, up = experts.w13_weight[e].split(128)
        assert torch.equal(gate, expected[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(up, expected[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(experts.w2_weight[e], expected[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5 + 3 * i for i in range(8)], seed=1)
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    hf = hf_model(reference)
    agree = sum(tokens == hf_greedy(hf, prompt, MAX_NEW_TOKENS, []) for prompt, tokens in zip(prompts, ours))
    assert agree >= 7, f"{agree} of {len(prompts)} prompts give Hugging Face's greedy ids"


def test_quantized_experts_keep_hugging_faces_ids_through_the_scheduler(tmp_path_factory, tiny_model_dir):
    """The FP8-expert model through a scheduler with chunked prefill of 16 and the radix cache off, then on (with
    every prompt again as a hit of all but its last token): Hugging Face's greedy ids on the dequantized checkpoint."""
    from scheduler_driver import SchedulerDriver
    from test_moe_models import check_batches_and_radix_hits

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=128)
    out, reference = str(tmp_path_factory.mktemp("q-moe-sched")), str(tmp_path_factory.mktemp("ref-moe-sched"))
    experts_checkpoint(base, out, reference, "hf-fp8")
    head = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [20], seed=11)[0]
    prompts = [head + p if i % 2 == 0 else p
               for i, p in enumerate(random_prompts(TINY_QUANT_LLAMA["vocab_size"], [6, 11, 17, 9], seed=5))]
    hf = hf_model(reference)
    expected = [hf_greedy(hf, p, MAX_NEW_TOKENS, []) for p in prompts]
    driver = SchedulerDriver(out, max_total_tokens=4096, chunked_prefill_size=16, disable_radix_cache=True)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.outputs() == expected and driver.scheduler.stats.cached_tokens == 0
    driver.close()
    check_batches_and_radix_hits(out, prompts, expected, "chunk-16")


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_quantized_experts_shard_over_two_ranks(tmp_path_factory, tiny_model_dir, ep_size):
    """Fine-grained FP8 experts, dequantized at load, over two gloo ranks: each expert's intermediate dimension split
    (ep 1) or whole experts per rank (ep 2); the greedy ids equal one rank's."""
    from test_tensor_parallel import _run_group

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=128)
    out, reference = str(tmp_path_factory.mktemp("q-moe-tp")), str(tmp_path_factory.mktemp("ref-moe-tp"))
    experts_checkpoint(base, out, reference, "hf-fp8")
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5, 9, 14], seed=4)
    [two_ranks] = _run_group(2, [out], prompts=prompts, max_new_tokens=16, ep_size=ep_size)
    assert two_ranks == greedy_generate(make_runner(out), prompts, 16)


def test_a_quantized_expert_missing_its_scale_is_named(tmp_path_factory, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=128)
    out, reference = str(tmp_path_factory.mktemp("q-moe-noscale")), str(tmp_path_factory.mktemp("ref-moe-noscale"))
    experts_checkpoint(base, out, reference, "hf-fp8")
    tensors = load_file(f"{out}/model.safetensors")
    del tensors["model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"]
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight of model\.layers\.0\.mlp\.experts\.2\.down_proj but not all of "
                                         r"weight, weight_scale_inv"):
        make_runner(out)
