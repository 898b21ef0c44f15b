"""Random-weight LoRA adapters made with PEFT itself, and the reference they are checked against.

`make_adapter` builds a PEFT `LoraConfig` on the given projections (and layers) of the Hugging Face model in
`model_dir`, fills every lora_A and lora_B matrix with fixed-seed normal weights (PEFT's own initialisation
zeroes B, which would leave the model unchanged) large enough to change greedy tokens, and writes the folder
with PEFT's `save_pretrained`. `merged_greedy` is the reference: the base model with the adapter loaded by PEFT
and merged into its weights (`merge_and_unload`), float32 on the CPU, decoding greedily.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION + MLP


def _base_model(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(folder: str, model_dir: str, rank: int = 8, alpha: float = 16.0, seed: int = 0, std: float = 0.3,
                 modules: Sequence[str] = ALL_MODULES, layers: Optional[Sequence[int]] = None) -> str:
    """Save a PEFT LoRA adapter for `model_dir` in `folder` (returned)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", init_lora_weights=False,
                        layers_to_transform=list(layers) if layers is not None else None)
    model = get_peft_model(_base_model(model_dir), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(folder)
    return folder


def merged_model(model_dir: str, adapter_dir: Optional[str]):
    """transformers' float32 model of `model_dir` with the adapter merged by PEFT (None: the base model)."""
    model = _base_model(model_dir)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()


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
