"""Which quantization method a checkpoint's `quantization_config` and `--quantization` choose, and the refusals, with
the reason, of what radixserve does not run (model_runner/quantization/methods.py)."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.quantization.fp8 import ActivationScheme
from radixserve.model_runner.quantization.methods import Fp8Method, Int4Method, quantization_method
from radixserve.runtime.wire.server_args import ServerArgs


def ct_config(weights: dict, inputs=None, fmt="float-quantized", ignore=("lm_head",)) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                  "input_activations": inputs, "format": fmt}}}}


FP8_TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}


def test_checkpoint_configs_choose_their_method():
    method = quantization_method(None, ct_config({"type": "float", "num_bits": 8, "strategy": "block",
                                                  "block_structure": [128, 128]}, FP8_TOKEN), torch.bfloat16)
    assert isinstance(method, Fp8Method) and method.block == (128, 128) and method.activation is ActivationScheme.TOKEN
    method = quantization_method("compressed-tensors", ct_config(
        {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False}, None,
        "pack-quantized"), torch.bfloat16)
    assert isinstance(method, Int4Method) and method.suffixes == ("weight_packed", "weight_scale", "weight_zero_point")
    method = quantization_method(None, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                                "weight_block_size": [128, 128]}}, torch.bfloat16)
    assert method.scale_name == "weight_scale_inv" and method.activation is ActivationScheme.GROUP
    method = quantization_method(None, {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                                "desc_act": True}}, torch.float16)
    assert method.act_order and method.zero_offset == 1
    online = quantization_method("fp8", {}, torch.bfloat16)  # SGLang's meanings of the two online spellings
    assert online.per_tensor and online.activation is ActivationScheme.TENSOR
    online = quantization_method("w8a8_fp8", {}, torch.bfloat16)
    assert not online.per_tensor and online.activation is ActivationScheme.TOKEN
    assert quantization_method(None, {}, torch.bfloat16) is None
    assert quantization_method("gguf", {}, torch.float32) is None


def test_ignored_modules_stay_in_16_bits():
    method = quantization_method(None, ct_config(FP8_TOKEN | {"strategy": "channel"}, FP8_TOKEN,
                                                 ignore=("lm_head", "re:.*layers\\.0\\..*")), torch.bfloat16)
    assert not method.quantizes("model.layers.0.self_attn.q_proj")
    assert method.quantizes("model.layers.1.self_attn.q_proj")


@pytest.mark.parametrize("flag, config, message", [
    ("awq", {}, "no quantization_config"),
    ("awq", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "checkpoint's quantization_config says 'gptq'"),
    (None, {"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes', which radixserve does not run"),
    (None, {"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}, "4-bit GEMM"),
    (None, {"quantization_config": {"quant_method": "gptq", "bits": 8}}, "8-bit weights"),
    (None, ct_config({"type": "float", "num_bits": 8, "strategy": "channel"}), r"W8A16\) are not supported"),
    (None, ct_config({"type": "int", "num_bits": 8, "strategy": "channel"}, None, "int-quantized"), "not supported"),
    ("gguf", {"quantization_config": {"quant_method": "fp8"}}, "GGUF file's blocks"),
    ("w8a8_fp8", {"quantization_config": {"quant_method": "fp8"}}, "quantizes a 16-bit checkpoint at load"),
])
def test_formats_that_cannot_run_are_refused_with_the_reason(flag, config, message):
    with pytest.raises(ValueError, match=message):
        quantization_method(flag, config, torch.bfloat16)


@pytest.mark.parametrize("value", ["fp8", "w8a8_fp8", "compressed-tensors", "awq", "gptq"])
def test_the_checkpoint_formats_are_accepted_on_every_device(value):
    assert ServerArgs(device="cpu", quantization=value).quantization == value
