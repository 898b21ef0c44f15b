"""Shared pytest fixtures.

`default_model_dir` (session): the Hugging Face directory of the embedded default model (SmolLM2-135M-Instruct
    GGUF, converted to float32 safetensors + tokenizer files). The conversion is cached in a stable folder,
    `$RADIXSERVE_CACHE_DIR` if set, else ~/.cache/radixserve, so it happens once per machine, not once per run.

`tiny_model_dir` (session): a factory `tiny_model_dir(arch, *, seed=0, with_tokenizer=False, **config_overrides)
    -> str` that saves a small random-weight Hugging Face model (config.json + model.safetensors, float32) with
    transformers' own classes and returns its directory. Same arguments -> same directory (built once per
    session). `arch` is "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma3",
    "gemma4", "qwen3_5" or "qwen3_next" (or the architecture class name). The Gemma models mix sliding layers
    (window 8) with full ones (`_TINY_WINDOWED`). The mixture-of-experts families get 8 experts, top-2, experts of
    width 32 (Mixtral's: `intermediate_size`), and Qwen2-MoE a shared expert of width 48. The hybrid Qwen3.5 gets
    4 layers (3 Gated DeltaNet, then full attention) with 2 key heads and 4 value heads of 16 in its linear layers;
    Qwen3-Next the same layout with the sparse feed-forward of Qwen2-MoE's shape on layers 0, 1 and 3.
    Defaults: hidden 64, 2 layers, 4 query heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512,
    rope_theta 50000 (not a library default, so a loader reading the wrong key fails), no EOS token (so
    generation runs to max_new_tokens); Qwen2 ties its embeddings, the others do not. Weights are drawn
    with a larger spread than transformers' init (matrices and biases ~ N(0, 0.2), norm scales ~ 1 + N(0, 0.1))
    so attention is peaked and logits well separated: position or RoPE mistakes change greedy tokens.
    `with_tokenizer=True` copies the default model's tokenizer files in and sets vocab_size to match, for
    tests that need text and chat templates. Any transformers config field can be overridden, e.g.
    `tiny_model_dir("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, ...})`.

`cache_dir` (session): the GGUF conversion cache folder used by `default_model_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

# The tests live in folders by subject; a test module may import another's helpers by its name
# (`from test_scheduler import make_prompts`), so every subject folder is on the path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _entry in sorted(os.scandir(_TESTS), key=lambda entry: entry.name):
    if _entry.is_dir() and _entry.name[0] not in "._" and _entry.path not in sys.path:
        sys.path.append(_entry.path)

# Triton decides between compiling and interpreting when it is first imported. Without a GPU the Triton kernels
# are tested under its interpreter, so the switch must be set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixserve.runtime.model_files import default_cache_dir, resolve_model  # noqa: E402

TINY_ARCHITECTURES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "gemma3": "Gemma3TextConfig",
    "gemma4": "Gemma4TextConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "gpt_oss": "GptOssConfig",
    "qwen3_next": "Qwen3NextConfig",
}
_CLASS_NAME_TO_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# The mixture-of-experts families: 8 experts of width 32, top-2 (Mixtral's experts take `intermediate_size`).
_TINY_MOE = {
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    # gpt-oss: sliding and full layers alternating, windows of 8 positions, YaRN over an original 64 positions, and a
    # SwiGLU limit low enough that its clamps engage at these weights.
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8,
                "swiglu_limit": 1.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "truncate": False}},
}
# Gemma 3: 4 layers, full attention in the last only, windows of 8 positions (shorter than most test prompts), its
# own RoPE base on the sliding layers, soft-capped logits and tied embeddings.
_TINY_WINDOWED = {
    "gemma3": {"num_hidden_layers": 4, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 50000.0}},
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
    # Gemma 4: 6 layers (two full), full layers with head_dim 32 and one KV head whose keys are the values, the last
    # two layers sharing the KV of layers 3 and 2 with double-wide MLPs, per-layer inputs of 8, proportional RoPE.
    "gemma4": {"num_hidden_layers": 6, "sliding_window": 8, "global_head_dim": 32, "num_global_key_value_heads": 1,
               "attention_k_eq_v": True, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
               "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                               "sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 50000.0}},
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
}
# The hybrid (Gated DeltaNet + full attention): 4 layers, the last attending fully; 2 key heads of 4 value heads each
# pair, heads of 16.
_TINY_HYBRID = {
    "qwen3_5": {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
    # Qwen3-Next: the same layout, with the sparse feed-forward on every layer but layer 2 (`mlp_only_layers`):
    # 8 experts of 32, top-2 renormalized, and a shared expert of 48.
    "qwen3_next": {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [2], "norm_topk_prob": True},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _tiny_config_kwargs(arch: str) -> dict:
    return {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        **_TINY_MOE.get(arch, {}),
        **_TINY_WINDOWED.get(arch, {}),
        **_TINY_HYBRID.get(arch, {}),
    }


def build_tiny_model(out_dir: str, arch: str, seed: int = 0, tokenizer_dir: str | None = None, **overrides) -> str:
    """Save a seeded random-weight `arch` model to `out_dir` (see the module docstring); return out_dir."""
    import torch
    import transformers

    arch = _CLASS_NAME_TO_ARCH.get(arch, arch)
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY_ARCHITECTURES)}")
    kwargs = _tiny_config_kwargs(arch)
    if tokenizer_dir is not None:
        kwargs["vocab_size"] = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    kwargs.update(overrides)
    config = getattr(transformers, TINY_ARCHITECTURES[arch])(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return os.environ.get("RADIXSERVE_CACHE_DIR") or default_cache_dir()


@pytest.fixture(scope="session")
def default_model_dir(cache_dir: str) -> str:
    return resolve_model(None, cache_dir=cache_dir).model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, request):
    built: dict[str, str] = {}

    def make(arch: str, *, seed: int = 0, with_tokenizer: bool = False, **overrides) -> str:
        key = json.dumps([arch, seed, with_tokenizer, overrides], sort_keys=True)
        if key not in built:
            tokenizer_dir = request.getfixturevalue("default_model_dir") if with_tokenizer else None
            out_dir = str(tmp_path_factory.mktemp(f"tiny-{_CLASS_NAME_TO_ARCH.get(arch, arch)}"))
            built[key] = build_tiny_model(out_dir, arch, seed=seed, tokenizer_dir=tokenizer_dir, **overrides)
        return built[key]

    return make
