"""A LoRA adapter in PEFT's format, read from its folder: `adapter_config.json` + `adapter_model.safetensors`.

PEFT names each low-rank pair after the module it adapts, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (`A`, `[r, in_features]`) and `...lora_B.weight`
(`B`, `[out_features, r]`); the adapted layer computes `W x + scale * B (A x)` with `scale = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). Supported: the attention projections q/k/v/o and the MLP's
gate/up/down of Llama-family decoders, without LoRA biases, DoRA or per-module ranks; anything else is refused
with the reason (`LoRAAdapterError`), never loaded half-way.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from radixserve.model_runner.loader.file_checks import ModelFileError, check_safetensors

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded (missing files, unsupported options, shapes that do not fit the model)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU: `weights[(layer, module)] = (A [r, in], B [out, r] * scale)`."""

    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(name: str, path: str, num_layers: int, shapes: dict[str, tuple[int, int]],
                 max_rank: int) -> LoRAAdapter:
    """Load and check the adapter in folder `path`. `shapes[module] = (in_features, out_features)` of the base
    model's projections (whole, not sharded); `max_rank` is `--max-lora-rank`."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path!r}")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_config.json needs a positive rank r")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    for option, allowed in (("bias", ("none", None)), ("use_dora", (False, None)), ("rank_pattern", ({}, None)),
                            ("alpha_pattern", ({}, None)), ("fan_in_fan_out", (False, None))):
        if config.get(option) not in allowed:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, path)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported "
                                   f"module ({', '.join(TARGET_MODULES)})")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGET_MODULES or layer >= num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts no layer of this model")
        pairs.setdefault((layer, module), {})[which] = tensor.to(torch.float32)
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no LoRA weights in {path!r}")

    adapter = LoRAAdapter(name, path, rank, scale, tuple(sorted({m for _, m in pairs})))
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this model needs A ({rank}, {in_features}) and B ({out_features}, {rank})")
        adapter.weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return adapter


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    for filename in WEIGHT_FILES:
        file = os.path.join(path, filename)
        if not os.path.isfile(file):
            continue
        if filename.endswith(".safetensors"):
            from safetensors.torch import load_file

            try:
                check_safetensors(file)
            except ModelFileError as error:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {error}") from None
            return load_file(file, device="cpu")
        return torch.load(file, map_location="cpu", weights_only=True)
    raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}")
