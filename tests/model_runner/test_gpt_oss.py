"""gpt-oss (`GptOssForCausalLM`) served on the CPU against Hugging Face.

A tiny random-weight model from transformers' `GptOssConfig`, saved with `save_pretrained` (tests/conftest.py: 2
layers, sliding then full, windows of 8 positions, shorter than most prompts; YaRN RoPE; 8 experts top-2 with biases;
a SwiGLU limit of 1 so the clamps engage):

- the config: experts, routing, activation, windows and RoPE read from gpt-oss's keys;
- greedy ids equal `transformers` generate over 32 tokens for 8 prompts, with the torch_native and the CPU kernel
  attention backends; the sinks matter (HF with them turned off gives other ids);
- through a real scheduler: chunked prefill of 16, mixed prefill/decode batches and radix-cache hits keep the ids;
- an MXFP4 checkpoint written here from known weights (the test's own quantizer) loads to the weights an independent
  float64 decoding of its bits gives, and generates as Hugging Face does on those weights;
- tensor parallelism (2 ranks, each half of every expert and of the heads' sinks) and expert parallelism (`--ep-size
  2`, four whole experts each) give the ids of one rank;
- benchmarks/configs/gpt-oss-20b.json builds, and its dummy weights fill every parameter (on the meta device).
"""

from __future__ import annotations

import json
import math
import shutil
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


# ---- MXFP4 checkpoints ---------------------------------------------------------------------------

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [..., K]` -> (blocks `[..., K/32, 16]`, scales `[..., K/32]`) uint8: per block of 32, the power of two
    that brings the largest magnitude within 6, then each value rounded to the nearest e2m1 code; the element of even
    index in the low nibble."""
    groups = weight.double().reshape(*weight.shape[:-1], -1, 32)
    largest = groups.abs().amax(-1).clamp(min=1e-30)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float64)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (nearest | ((scaled < 0) & (nearest > 0)).to(torch.int64) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)


def decode_mxfp4_float64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference decoding, from the bits: sign, two exponent bits (bias 1), one mantissa bit; subnormal at
    exponent 0; times 2^(scale - 127)."""
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64).reshape(*scales.shape, 32)
    sign = 1.0 - 2.0 * ((nibbles >> 3) & 1).double()
    exponent, mantissa = ((nibbles >> 1) & 3).double(), (nibbles & 1).double()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa / 2) * torch.exp2(exponent - 1))
    values = sign * magnitude * torch.exp2(scales.double() - 127).unsqueeze(-1)
    return values.reshape(*scales.shape[:-1], -1)


def test_mxfp4_round_trip_of_the_test_quantizer():
    weight = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    blocks, scales = quantize_mxfp4(weight)
    decoded = decode_mxfp4_float64(blocks, scales)
    assert decoded.shape == weight.shape
    # Within half a step of the coarsest codes (steps of 2 at the top of [4, 6]) times each block's scale.
    step = torch.exp2(scales.double() - 127).repeat_interleave(32, -1)
    assert ((decoded - weight).abs() <= step + 1e-12).all()
    # The radixserve decoder agrees with the reference bit for bit.
    from radixserve.model_runner.quantization.mxfp4 import dequantize_mxfp4

    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float64), decoded)
    # And as FP8 values with a scale per block of 32, exactly.
    from radixserve.model_runner.quantization.mxfp4 import mxfp4_as_fp8

    values, block_scales = mxfp4_as_fp8(blocks, scales)
    assert values.dtype == torch.float8_e4m3fn and block_scales.shape == scales.shape
    assert torch.equal(values.double() * block_scales.double().repeat_interleave(32, -1), decoded)


@pytest.fixture(scope="module")
def mxfp4_dirs(model_dir, tmp_path_factory):
    """(the MXFP4 checkpoint, a 16-bit checkpoint of the weights its bits decode to, the decoded experts per layer):
    the tiny model's experts quantized, in the released checkpoints' layout ([E, out, in], in split in blocks)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    quantized, dequantized, decoded = {}, {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            quantized[name] = dequantized[name] = tensor
            continue
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [E, in, out] -> [E, out, in]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        decoded[name] = decode_mxfp4_float64(blocks, scales)  # [E, out, in]
        dequantized[name] = decoded[name].transpose(1, 2).float().contiguous()
    dirs = []
    for label, weights in (("mxfp4", quantized), ("decoded", dequantized)):
        out = tmp_path_factory.mktemp(f"gpt-oss-{label}")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if label == "mxfp4":
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(config))
        for extra in ("generation_config.json",):
            if (Path(model_dir) / extra).exists():
                shutil.copy(Path(model_dir) / extra, out)
        save_file(weights, str(out / "model.safetensors"))
        dirs.append(str(out))
    return dirs[0], dirs[1], decoded


def test_mxfp4_checkpoint_loads_the_decoded_weights_and_generates_as_transformers(mxfp4_dirs, prompts):
    mxfp4_dir, decoded_dir, decoded = mxfp4_dirs
    runner = make_runner(mxfp4_dir)
    for layer_id, layer in enumerate(runner.model.model.layers):
        experts = layer.mlp.experts
        gate_up = decoded[f"model.layers.{layer_id}.mlp.experts.gate_up_proj"]  # [E, 2I] rows interleaved
        down = decoded[f"model.layers.{layer_id}.mlp.experts.down_proj"]
        assert torch.equal(experts.w13_weight.double(), torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        assert torch.equal(experts.w2_weight.double(), down)
    reference = hf_model(decoded_dir)
    assert greedy_generate(runner, prompts, MAX_NEW_TOKENS) == [
        hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]


def held_mxfp4_values(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `w13 [E, 2I, H]`, `w2 [E, H, I]` of experts held as MXFP4 (`FusedMoE.keep_mxfp4`), decoded by the
    reference decoder from the held words and exponent bytes put back in the checkpoint's byte layout."""
    from radixserve.model_runner.quantization.int4 import unpack_rows

    def values(words: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:  # [K / 8, N], [K / 32, N]
        codes = unpack_rows(words).t()  # [N, K]
        blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(codes.shape[0], -1, 16)
        return decode_mxfp4_float64(blocks, exponents.t().contiguous())

    return tuple(torch.stack([values(w, e) for w, e in zip(weight, scale)])
                 for weight, scale in ((experts.w13_weight, experts.w13_weight_scale),
                                       (experts.w2_weight, experts.w2_weight_scale)))


@pytest.mark.parametrize("form", ["mxfp4", "fp8"])
def test_mxfp4_experts_held_quantized_generate_as_transformers(mxfp4_dirs, model_dir, prompts, form, monkeypatch):
    """Loaded as on CUDA (`quantized_experts`, the fused kernels under the Triton interpreter): the experts hold the
    checkpoint's own codes and exponents (`MXFP4_EXPERTS` "mxfp4", the default), or FP8 values and a scale per 32
    ("fp8"), whose values are the decoded weights bit for bit, and generate as Hugging Face on those weights. A 16-bit
    checkpoint keeps 16-bit experts."""
    from radixserve.model_runner.models import gpt_oss
    from test_quantized_experts import dequantized, with_quantized_experts

    monkeypatch.setattr(gpt_oss, "MXFP4_EXPERTS", form)
    mxfp4_dir, decoded_dir, decoded = mxfp4_dirs
    runner = with_quantized_experts(mxfp4_dir)
    for layer_id, layer in enumerate(runner.model.model.layers):
        experts = layer.mlp.experts
        assert experts.scale_blocks == ((1, 32), (1, 32)) and experts.mxfp4 == (form == "mxfp4")
        assert experts.w13_weight.dtype == (torch.int32 if form == "mxfp4" else torch.float8_e4m3fn)
        gate_up = decoded[f"model.layers.{layer_id}.mlp.experts.gate_up_proj"]
        w13, w2 = held_mxfp4_values(experts) if form == "mxfp4" else dequantized(experts)
        assert torch.equal(w13.double(), torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        assert torch.equal(w2.double(), decoded[f"model.layers.{layer_id}.mlp.experts.down_proj"])
    reference = hf_model(decoded_dir)
    assert greedy_generate(runner, prompts[:4], 16) == [hf_greedy(reference, p, 16, []) for p in prompts[:4]]
    assert with_quantized_experts(model_dir).model.model.layers[0].mlp.experts.scale_blocks is None


def test_16_bit_experts_under_an_mxfp4_config_are_quantized_per_32(mxfp4_dirs, tmp_path, monkeypatch):
    """16-bit expert tensors (random weights for an MXFP4 config, as the GPU benchmarks load) become MXFP4 codes, or
    FP8 with one scale per 32 values as `Fp8Weight.quantize` makes them. The 16-bit values here are MXFP4's own
    (the decoded checkpoint), so MXFP4 holds them exactly."""
    from safetensors.torch import load_file

    from radixserve.model_runner.models import gpt_oss
    from radixserve.model_runner.quantization.fp8 import Fp8Weight
    from test_quantized_experts import dequantized, with_quantized_experts

    mxfp4_dir, decoded_dir, decoded = mxfp4_dirs
    shutil.copytree(decoded_dir, tmp_path / "m")
    shutil.copy(Path(mxfp4_dir) / "config.json", tmp_path / "m" / "config.json")
    runner = with_quantized_experts(str(tmp_path / "m"))
    _, w2 = held_mxfp4_values(runner.model.model.layers[1].mlp.experts)
    assert torch.equal(w2, decoded["model.layers.1.mlp.experts.down_proj"])
    assert all(len(ids) == 4 for ids in greedy_generate(runner, [[1, 2, 3]], 4))

    monkeypatch.setattr(gpt_oss, "MXFP4_EXPERTS", "fp8")
    runner = with_quantized_experts(str(tmp_path / "m"))
    down = load_file(str(tmp_path / "m" / "model.safetensors"))["model.layers.1.mlp.experts.down_proj"]  # [E, in, out]
    _, w2 = dequantized(runner.model.model.layers[1].mlp.experts)
    for e in range(down.shape[0]):
        assert torch.equal(w2[e], Fp8Weight.quantize(down[e].t().float(), (1, 32)).dequantize())


def test_mxfp4_experts_slice_under_tensor_parallelism():
    """Rank 1 of 2 holds the second half of every expert's gate and up rows (de-interleaved) and of down's reduced
    features, as the stored codes and exponents; a half that is not whole blocks of 32 is refused."""
    from radixserve.model_runner.models.gpt_oss import Mxfp4Tensor, _copy_experts
    from radixserve.model_runner.moe import FusedMoE
    from radixserve.model_runner.parallel import TPGroup

    hidden, intermediate = 64, 128
    generator = torch.Generator().manual_seed(4)
    gate_up = Mxfp4Tensor(*quantize_mxfp4(torch.randn(2, 2 * intermediate, hidden, generator=generator)))
    down = Mxfp4Tensor(*quantize_mxfp4(torch.randn(2, hidden, intermediate, generator=generator)))
    experts = FusedMoE(2, hidden, intermediate, TPGroup(rank=1, size=2), bias=True)
    assert experts.keep_mxfp4() and experts.w13_weight.dtype == torch.int32 and experts.w2_weight.shape == (2, 8, 64)
    _copy_experts(experts, "gate_up_proj", False, gate_up, experts.w13_weight.data)
    _copy_experts(experts, "down_proj", False, down, experts.w2_weight.data)
    w13, w2 = held_mxfp4_values(experts)
    full13 = decode_mxfp4_float64(gate_up.blocks, gate_up.scales)  # [E, 2I, H], gate and up rows interleaved
    assert torch.equal(w13, torch.cat([full13[:, 0::2][:, 64:], full13[:, 1::2][:, 64:]], dim=1))
    assert torch.equal(w2, decode_mxfp4_float64(down.blocks, down.scales)[:, :, 64:])
    assert not FusedMoE(2, hidden, 96, TPGroup(rank=0, size=2)).keep_mxfp4()  # 48 features a rank


def test_the_library_quantizer_rounds_as_the_reference(mxfp4_dirs):
    """`quantize_mxfp4` of random 16-bit weights decodes to the test quantizer's values (the same rule: the smallest
    power of two bringing each block within 6, then the nearest code)."""
    from radixserve.model_runner.quantization.mxfp4 import quantize_mxfp4 as library_quantize

    weight = (torch.randn(6, 128, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    ours = decode_mxfp4_float64(*library_quantize(weight))
    assert torch.equal(ours, decode_mxfp4_float64(*quantize_mxfp4(weight.float())))
    zeros = decode_mxfp4_float64(*library_quantize(torch.zeros(2, 32)))
    assert torch.equal(zeros, torch.zeros(2, 32, dtype=torch.float64))


def test_quantization_flag_mxfp4_names_the_checkpoints_format(mxfp4_dirs, model_dir):
    """SGLang's `--quantization mxfp4` on an MXFP4 checkpoint loads it as without the flag; on a 16-bit one it is
    refused, naming what is missing."""
    mxfp4_dir, _, decoded = mxfp4_dirs
    experts = make_runner(mxfp4_dir, quantization="mxfp4").model.model.layers[0].mlp.experts
    assert torch.equal(experts.w2_weight.double(), decoded["model.layers.0.mlp.experts.down_proj"])
    with pytest.raises(ValueError, match="quantization 'mxfp4' loads checkpoints in that format"):
        make_runner(model_dir, quantization="mxfp4")


def test_mxfp4_checkpoint_on_two_ranks(mxfp4_dirs, prompts):
    """Each rank reads its half of every expert from the lazily read MXFP4 tensors (the blocks of its rows only)."""
    from test_tensor_parallel import _run_group

    mxfp4_dir, decoded_dir, _ = mxfp4_dirs
    [ids] = _run_group(2, [mxfp4_dir], prompts=prompts[:4], max_new_tokens=8)
    reference = hf_model(decoded_dir)
    assert ids == [hf_greedy(reference, p, 8, []) for p in prompts[:4]]


def test_mxfp4_checkpoint_missing_its_scales_is_refused(mxfp4_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    mxfp4_dir = Path(mxfp4_dirs[0])
    tensors = load_file(str(mxfp4_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    shutil.copy(mxfp4_dir / "config.json", tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="without their blocks or scales: model.layers.1.mlp.experts.down_proj"):
        make_runner(str(tmp_path))


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
