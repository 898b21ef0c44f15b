"""gpt-oss's MXFP4 checkpoints (models/gpt_oss.py, quantization/mxfp4.py) on the tiny model of test_gpt_oss.py.

- a checkpoint written here from known weights (the test's own quantizer, in the released checkpoints' layout) loads
  to the weights an independent float64 decoding of its bits gives, and generates as Hugging Face does on those
  weights: dequantized (the CPU default), and held as MXFP4 or as FP8 for the fused MoE kernels (under the Triton
  interpreter);
- 16-bit weights under an MXFP4 config, the library's quantizer, the slicing of the codes under tensor parallelism,
  two ranks, `--quantization mxfp4`, and a checkpoint missing its scales.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_gpt_oss import model_dir, prompts  # noqa: F401  (fixtures)
from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, make_runner

from radixserve.model_runner.static_generate import greedy_generate

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
