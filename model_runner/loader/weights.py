"""Weight sources for the model code: safetensors files of a Hugging Face directory, or seeded random weights.

Both yield `(hf_name, tensor)` pairs under Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`,
...); the model's `load_weights` maps them onto its own (fused) parameters.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.loader.file_checks import check_safetensors
from radixserve.runtime.wire.model_files import safetensors_files

# Random weights: normal(0, std) for matrices, ones for norm scales, zeros for biases (like transformers' init).
DUMMY_WEIGHT_STD = 0.02


def iter_weights(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield every tensor of the model's safetensors files, one at a time (files are memory-mapped lazily).

    With `lazy`, yield safetensors slices instead of tensors (valid until the next item): a tensor-parallel
    rank indexes them to read only its own part.

    A tqdm progress bar appears when the load lasts more than a second. Raises FileNotFoundError when the
    directory holds no safetensors file, ModelFileError when a file's header is malformed.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    total = 0
    for path in files:
        check_safetensors(path)  # a malformed header is a ModelFileError naming its defect
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", delay=1.0) as progress:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
                    progress.update(1)


def dummy_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a model with this config (the checkpoint's layout)."""
    if config.model_type == "gemma4_text":
        raise ValueError("dummy weights are not laid out for Gemma 4 (per-layer shapes, shared KV, per-layer inputs); "
                         "load a checkpoint")
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_size, hidden)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (q_size,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv_size,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv_size,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_size)
        if config.model_type == "gpt_oss":  # o's bias with q/k/v's, and one attention-sink logit per head
            if config.attention_bias:
                shapes[f"{prefix}.self_attn.o_proj.bias"] = (hidden,)
            shapes[f"{prefix}.self_attn.sinks"] = (config.num_attention_heads,)
        if config.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if config.model_type == "gemma3_text":
            shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (hidden,)
        if config.moe is not None and layer in config.moe.sparse_layers:
            shapes.update(_sparse_mlp_shapes(config, prefix))
        else:
            shapes.update(_mlp_shapes(f"{prefix}.mlp", hidden, config.intermediate_size))
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, intermediate: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    gate, up, down = names
    return {f"{prefix}.{gate}.weight": (intermediate, hidden), f"{prefix}.{up}.weight": (intermediate, hidden),
            f"{prefix}.{down}.weight": (hidden, intermediate)}


def _sparse_mlp_shapes(config: ModelConfig, layer_prefix: str) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts layer's tensors as its family's checkpoints name them (Mixtral: `block_sparse_moe`,
    experts' `w1`/`w3`/`w2`; gpt-oss: a biased `router` and the experts stacked, gate and up interleaved in one
    16-bit `gate_up_proj [E, H, 2I]`)."""
    moe, hidden = config.moe, config.hidden_size
    if config.model_type == "gpt_oss":
        prefix, experts, intermediate = f"{layer_prefix}.mlp", moe.num_experts, moe.intermediate_size
        return {f"{prefix}.router.weight": (experts, hidden), f"{prefix}.router.bias": (experts,),
                f"{prefix}.experts.gate_up_proj": (experts, hidden, 2 * intermediate),
                f"{prefix}.experts.gate_up_proj_bias": (experts, 2 * intermediate),
                f"{prefix}.experts.down_proj": (experts, intermediate, hidden),
                f"{prefix}.experts.down_proj_bias": (experts, hidden)}
    mixtral = config.model_type == "mixtral"
    prefix = f"{layer_prefix}.block_sparse_moe" if mixtral else f"{layer_prefix}.mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {f"{prefix}.gate.weight": (moe.num_experts, hidden)}
    for expert in range(moe.num_experts):
        shapes.update(_mlp_shapes(f"{prefix}.experts.{expert}", hidden, moe.intermediate_size, names))
    if moe.shared_expert_intermediate_size:
        shapes.update(_mlp_shapes(f"{prefix}.shared_expert", hidden, moe.shared_expert_intermediate_size))
        shapes[f"{prefix}.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def dummy_weights(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device | str] = None,
    shapes: Optional[dict[str, tuple[int, ...]]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield seeded random weights for `config` under Hugging Face names (same names as a checkpoint).

    Matrices ~ normal(0, 0.02), norm scales = 1, biases = 0. The same (config, seed, device) gives the same
    tensors on every run. Tensors are drawn on `device` (default CPU), so large shapes need no host copy. `shapes`:
    the checkpoint layout when the model states its own (`hf_weight_shapes()` of a hybrid), else the decoder's.
    """
    device = torch.device(device or "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in (shapes or dummy_weight_shapes(config)).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)
        yield name, tensor
