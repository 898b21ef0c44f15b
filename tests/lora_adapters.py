"""Random-weight LoRA adapters in PEFT's format, and the reference they are checked against.

`make_adapter` writes `adapter_config.json` + `adapter_model.safetensors` as PEFT saves them (tensor names
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`) with fixed-seed normal weights
large enough to change greedy tokens. `merged_greedy` is the reference: Hugging Face transformers' model of the
same folder with `W + scale * B @ A` merged into a float32 copy of each adapted weight, decoding greedily.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION + MLP


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, from a Hugging Face config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def make_adapter(folder: str, model_dir: str, rank: int = 8, alpha: float = 16.0, seed: int = 0, std: float = 0.3,
                 modules: Sequence[str] = ALL_MODULES, layers: Optional[Sequence[int]] = None) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(config["num_hidden_layers"]):
        for module in modules:
            in_features, out_features = shapes[module]
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                   "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir,
                   "fan_in_fan_out": False, "use_rslora": False}, f)
    return folder


def merged_model(model_dir: str, adapter_dir: Optional[str]):
    """transformers' float32 model of `model_dir` with the adapter merged into its weights (None: the base)."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
            params[target].add_(scale * (b.double() @ a.double()).float())
    return model


def merged_greedy(model_dir: str, adapter_dir: Optional[str], prompts: list[list[int]],
                  max_new_tokens: int) -> list[list[int]]:
    model = merged_model(model_dir, adapter_dir)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
