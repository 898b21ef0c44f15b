"""Quantized test checkpoints made from a tiny random Llama (or mixture of experts), each beside the float32 Hugging
Face model whose weights are the checkpoint's dequantized values (the reference the runner is compared with).

compressed-tensors checkpoints are written by the `compressed-tensors` package itself (its `ModelCompressor`, from
scales computed here with its `calculate_qparams`), and dequantized by it too. AWQ, GPTQ and Hugging Face's
fine-grained FP8 are written here from the formats' published definitions (AutoAWQ's `WQLinear_GEMM` packing, GPTQ's
v1 packing with zero points minus one, the `weight_scale_inv` block layout), in code independent of the loader's.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

# A tiny Llama whose projections split into whole 128-wide blocks and groups (q: 256 rows, k/v: 128, MLP: 512).
TINY_QUANT_LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 64, "vocab_size": 512}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _linears(model: torch.nn.Module):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            yield name, module


def _reference_from(model: torch.nn.Module, dequantized: dict[str, torch.Tensor], out_dir: str) -> str:
    """Save `model` with its projections replaced by `dequantized` values as a float32 checkpoint; return the dir."""
    with torch.no_grad():
        for name, module in _linears(model):
            module.weight.copy_(dequantized[name])
    model.to(torch.float32).save_pretrained(out_dir)
    return out_dir


def _load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _copy_config(model_dir: str, out_dir: str, quantization_config: dict) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _save_tensors(model: torch.nn.Module, replaced: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    tensors = {}
    for name, value in model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module in replaced and suffix == "weight":  # biases stay beside the quantized tensors
            continue
        tensors[name] = value.contiguous()
    for module, parts in replaced.items():
        for suffix, value in parts.items():
            tensors[f"{module}.{suffix}"] = value.contiguous()
    tensors.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


# ---- compressed-tensors, written by the package ----------------------------------------------------------

def compressed_tensors_checkpoint(model_dir: str, out_dir: str, reference_dir: str, scheme: str) -> None:
    """`scheme`: "fp8-tensor", "fp8-channel", "fp8-block" (dynamic per-token FP8 activations) or "w4a16"
    (4-bit symmetric groups of 128) or "w4a16-asym"."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    if scheme.startswith("w4a16"):
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=scheme == "w4a16", strategy="group",
                                   group_size=128)
        activations, fmt = None, "pack-quantized"
    else:
        strategy = scheme.split("-")[1]
        extra = {"block_structure": [128, 128]} if strategy == "block" else {}
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **extra)
        activations = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        fmt = "float-quantized"
    model = _load(model_dir)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=activations)},
        ignore=["lm_head"]))
    with torch.no_grad():
        for _, module in _linears(model):
            w = module.weight.float()
            n, k = w.shape
            if weights.strategy == "group":
                grouped = w.view(n, k // 128, 128)
                low, high = grouped.amin(-1), grouped.amax(-1)
            elif weights.strategy == "channel":
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            elif weights.strategy == "tensor":
                low, high = w.amin().reshape(1), w.amax().reshape(1)
            else:
                blocks = w.view(n // 128, 128, k // 128, 128)
                low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
            scale, zero_point = calculate_qparams(low, high, weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    compressor.decompress_model(model)  # the package's own dequantization: the reference's weights
    dequantized = {name: module.weight.detach().float().clone() for name, module in _linears(model)}
    _reference_from(_load(model_dir), dequantized, reference_dir)


# ---- AWQ and GPTQ, written from the published layouts -------------------------------------------------------

def _quantize_groups(w: torch.Tensor, group_size: int, g_idx: torch.Tensor):
    """Asymmetric 4-bit round-to-nearest per group (float64): int values [N, K], scales and zeros [N, groups]."""
    w = w.double()
    n, k = w.shape
    groups = k // group_size
    low = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    high = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    scales = ((high - low) / 15).clamp_min(1e-6).half().double()  # stored in float16
    zeros = (-low / scales).round().clamp(0, 15)
    q = (w / scales[:, g_idx] + zeros[:, g_idx]).round().clamp(0, 15)
    return q.to(torch.int32), scales, zeros.to(torch.int32)


def _pack_along_columns(values: torch.Tensor, order) -> torch.Tensor:
    """[R, C] int values to [R, C / 8] int32, nibble j of word c holding column 8c + order[j]."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j, column in enumerate(order):
        packed |= values[:, column::8].to(torch.int64) << (4 * j)
    return packed.to(torch.int32) if packed.max() < 2**31 else (packed - (packed >= 2**31) * 2**32).to(torch.int32)


def _pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] int values to [R / 8, C] int32, nibble j of word r holding row 8r + j."""
    return _pack_along_columns(values.T.contiguous(), range(8)).T.contiguous()


def _gptq_v1(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's tensors in GPTQ's v1 layout (rows packed, zero points minus one), from `_quantize_groups`."""
    return {"qweight": _pack_along_rows(q.T.contiguous()),
            "qzeros": _pack_along_columns((zeros - 1).T.contiguous() & 0xF, range(8)),
            "scales": scales.T.half().contiguous(), "g_idx": g_idx.to(torch.int32)}


def int4_checkpoint(model_dir: str, out_dir: str, reference_dir: str, fmt: str, act_order: bool = False,
                    seed: int = 0) -> None:
    """`fmt`: "awq" (GEMM layout) or "gptq" (v1, optionally act-order: one random column order per input, shared by
    the projections that read it, as GPTQ's Hessian order is)."""
    group_size = 128
    model = _load(model_dir)
    generator = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, int], torch.Tensor] = {}
    replaced, dequantized = {}, {}
    for name, module in _linears(model):
        w = module.weight.detach()
        n, k = w.shape
        g_idx = torch.arange(k) // group_size
        if act_order:
            reader = name.rsplit(".", 1)[0] + (".o" if name.endswith("o_proj") else ".down" if name.endswith(
                "down_proj") else "")
            order = orders.setdefault((reader, k), torch.randperm(k, generator=generator))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group_size
        q, scales, zeros = _quantize_groups(w, group_size, g_idx)
        dequantized[name] = ((q.double() - zeros[:, g_idx].double()) * scales[:, g_idx]).float()
        if fmt == "awq":
            replaced[name] = {"qweight": _pack_along_columns(q.T.contiguous(), AWQ_ORDER),
                              "qzeros": _pack_along_columns(zeros.T.contiguous(), AWQ_ORDER),
                              "scales": scales.T.half().contiguous()}
        else:
            replaced[name] = _gptq_v1(q, scales, zeros, g_idx)
    os.makedirs(out_dir, exist_ok=True)
    _save_tensors(model, replaced, out_dir)
    if fmt == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
                  "checkpoint_format": "gptq"}
    _copy_config(model_dir, out_dir, config)
    _reference_from(_load(model_dir), dequantized, reference_dir)


# ---- Hugging Face fine-grained FP8 ----------------------------------------------------------------------------

def _fp8_blocks(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear `w [N, K]` (multiples of 128) as `weight` float8_e4m3fn and `weight_scale_inv` float32 per 128x128
    block (value = weight * scale_inv), and its dequantized values in float64."""
    w = w.double()
    n, k = w.shape
    blocks = w.view(n // 128, 128, k // 128, 128)
    scale_inv = blocks.abs().amax((1, 3)) / 448.0
    q = (blocks / scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    scale_inv = scale_inv.float()
    expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return {"weight": q, "weight_scale_inv": scale_inv}, q.double() * expanded.double()


def hf_fp8_block_checkpoint(model_dir: str, out_dir: str, reference_dir: str) -> None:
    """`weight` float8_e4m3fn and `weight_scale_inv` float32 per 128x128 block (value = weight * scale_inv)."""
    model = _load(model_dir)
    replaced, dequantized = {}, {}
    for name, module in _linears(model):
        replaced[name], values = _fp8_blocks(module.weight.detach())
        dequantized[name] = values.float()
    os.makedirs(out_dir, exist_ok=True)
    _save_tensors(model, replaced, out_dir)
    _copy_config(model_dir, out_dir, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})
    _reference_from(_load(model_dir), dequantized, reference_dir)


# ---- the references' activations ----------------------------------------------------------------------------

def scaled_projections(model_dir: str, out_dir: str, factor: float) -> str:
    """A copy of the model with its projections multiplied by `factor`: the tiny models' weights (std 0.2) make
    attention so peaked that any 2% change of a projection flips tokens; at std 0.05 FP8's rounding can be measured."""
    model = _load(model_dir)
    with torch.no_grad():
        for _, module in _linears(model):
            module.weight.mul_(factor)
    model.save_pretrained(out_dir)
    return out_dir


def quantize_projection_inputs(model: torch.nn.Module, group: int | str | None) -> torch.nn.Module:
    """Make every projection of `model` see its input rounded to FP8 e4m3 as the W8A8 formats define it: per token
    (`group` None), per token and group of `group` features, or per call ("tensor"); scale = amax / 448."""
    def round_input(module, args):
        x = args[0]
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if isinstance(group, int):
            rows = rows.reshape(rows.shape[0], -1, group)
        if group == "tensor":
            scale = (rows.abs().amax() / 448.0).clamp_min(1e-12)
        else:
            scale = (rows.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
        rounded = (rows / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return (rounded.reshape(shape).to(x.dtype),) + tuple(args[1:])

    for _, module in _linears(model):
        module.register_forward_pre_hook(round_input)
    return model


# ---- quantized experts ----------------------------------------------------------------------------------------

def experts_checkpoint(model_dir: str, out_dir: str, reference_dir: str, fmt: str) -> None:
    """A mixture of experts' checkpoint (`mlp.experts.<e>.<projection>.weight` tensors) written from the model's
    safetensors, the reference holding the dequantized values. `fmt` "hf-fp8": every expert's projections in Hugging
    Face's fine-grained FP8 (128x128 blocks, `weight_scale_inv`, as Qwen3-30B-A3B-FP8 ships them), the attention
    projections listed in `modules_to_not_convert`; "gptq": every projection, the experts' and the attention's, in
    GPTQ's v1 layout (groups of 128, asymmetric)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    quantized, reference = {}, {}
    for name, value in tensors.items():
        is_expert = ".experts." in name
        if not name.endswith("_proj.weight") or not (is_expert or fmt == "gptq"):
            quantized[name] = reference[name] = value.contiguous()
            continue
        if fmt == "hf-fp8":
            parts, dequantized = _fp8_blocks(value)
        else:
            g_idx = torch.arange(value.shape[1]) // 128
            q, scales, zeros = _quantize_groups(value, 128, g_idx)
            parts = _gptq_v1(q, scales, zeros, g_idx)
            dequantized = (q.double() - zeros[:, g_idx].double()) * scales[:, g_idx]
        linear = name.removesuffix(".weight")
        quantized.update({f"{linear}.{suffix}": part for suffix, part in parts.items()})
        reference[name] = dequantized.to(value.dtype)
    quantization_config = ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["self_attn", "lm_head"]} if fmt == "hf-fp8" else
                           {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                            "checkpoint_format": "gptq"})
    for out, values in ((out_dir, quantized), (reference_dir, reference)):
        os.makedirs(out, exist_ok=True)
        for extra in os.listdir(model_dir):
            if extra != "model.safetensors" and os.path.isfile(os.path.join(model_dir, extra)):
                shutil.copy(os.path.join(model_dir, extra), out)
        save_file({k: v.contiguous() for k, v in values.items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
    _copy_config(model_dir, out_dir, quantization_config)
