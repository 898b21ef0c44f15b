"""Model configuration: the fields the runtime's model code needs, read from a Hugging Face `config.json`.

`ModelConfig` normalises the differences between config generations so model code never looks at raw keys:

- RoPE: older configs carry `rope_theta` and `rope_scaling` (scaling type under "type" or "rope_type");
  transformers 5 writes one `rope_parameters` dict holding `rope_theta` together with the scaling fields and
  `"rope_type": "default"` when there is no scaling. Both give the same `rope_theta` / `rope_scaling` here;
  `rope_scaling` is None for plain RoPE and otherwise always has a "rope_type" key.
- EOS: `eos_token_ids` is the union (config first, order kept) of `eos_token_id` in config.json and in
  generation_config.json, each of which may be an int or a list.
- Per-architecture facts: Qwen2 always has q/k/v biases (Qwen2-MoE unless `qkv_bias` says otherwise); Qwen3 and
  Qwen3-MoE always have per-head q/k RMSNorm.
- Mixtures of experts: `moe` (a `MoEConfig`) holds the expert count, the routing rule and which layers are sparse,
  read from the family's own keys (`num_experts` or `num_local_experts`, `moe_intermediate_size` or Mixtral's
  `intermediate_size`); None for dense models.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

# Architecture name -> Hugging Face model_type. The model code registers one implementation per entry.
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    # Pooling only (model_runner/pooling.py): sequence classifiers and an encoder.
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "BertModel": "bert",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_MODEL_TYPES)
# A config.json without `architectures` names the family's causal LM.
_MODEL_TYPE_ARCHITECTURES = {v: k for k, v in ARCHITECTURE_MODEL_TYPES.items()
                             if k.endswith("ForCausalLM") or k == "BertModel"}

# transformers' own defaults for keys a config.json may omit (they differ by family).
_DEFAULT_MAX_POSITIONS = {"bert": 512, "llama": 2048, "mistral": 32768, "qwen2": 32768, "qwen3": 32768, "qwen2_moe": 32768,
                          "qwen3_moe": 32768, "mixtral": 131072, "qwen3_5_text": 32768}
_DEFAULT_RMS_EPS = {"bert": 1e-12, "llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6,
                    "mixtral": 1e-5, "qwen3_5_text": 1e-6}
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
# Hybrids of Gated DeltaNet (linear attention) and full-attention layers.
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5_text",)
_DEFAULT_ROPE_THETA = 10000.0


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _normalise_rope(d: dict) -> tuple[float, Optional[dict]]:
    """Return (rope_theta, rope_scaling) from either config generation; see the module docstring."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type RoPE (e.g. {"full_attention": {...}}); the supported families use full attention.
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = dict(d.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts model.

    Routing (`routing`): "softmax_topk" takes the softmax over all experts, then the top `top_k` probabilities,
    divided by their sum when `renormalize` (Qwen's `norm_topk_prob`); "topk_softmax" takes the top `top_k` router
    logits and a softmax over those (Mixtral; renormalized by construction). `shared_expert_intermediate_size` > 0
    adds a dense expert that every token passes through, scaled by a sigmoid gate (Qwen2-MoE). Layers not in
    `sparse_layers` keep a dense MLP of the model's `intermediate_size`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    renormalize: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown MoE routing {self.routing!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts ({self.num_experts})]")
        if self.intermediate_size <= 0:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")

    @classmethod
    def from_dict(cls, d: dict, model_type: str) -> "MoEConfig":
        num_layers = int(d["num_hidden_layers"])
        num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        if num_experts <= 0:
            raise ValueError(f"a {model_type} config needs num_experts > 0")
        if model_type == "mixtral":
            return cls(num_experts, int(d["num_experts_per_tok"]), int(d["intermediate_size"]), "topk_softmax",
                       True, frozenset(range(num_layers)))
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num_experts, int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]), "softmax_topk",
                   bool(d.get("norm_topk_prob", False)), sparse, int(d.get("shared_expert_intermediate_size") or 0))


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5): which layers they are and their shapes.

    A linear layer keeps, per request, a convolution state `[conv_dim, conv_kernel_size - 1]` (the last inputs of its
    causal conv1d over q, k and v) and a recurrent state `[num_value_heads, key_head_dim, value_head_dim]` instead of
    KV; the other layers are full attention with a KV cache. Each key head serves `num_value_heads //
    num_key_heads` value heads.
    """

    linear_layers: frozenset[int]
    conv_kernel_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel_size < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel_size}")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q and k (key_dim each) and v."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> "LinearAttentionConfig":
        num_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:  # transformers' rule: every `full_attention_interval`-th layer attends fully
            interval = int(d.get("full_attention_interval") or 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers for num_hidden_layers {num_layers}")
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        return cls(frozenset(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
                   int(d.get("linear_conv_kernel_dim", 4)), int(d.get("linear_num_key_heads", 16)),
                   int(d.get("linear_num_value_heads", 32)), int(d.get("linear_key_head_dim", 128)),
                   int(d.get("linear_value_head_dim", 128)))


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model, normalised across config formats.

    `head_dim` is always set (explicit in the config, else hidden_size // num_attention_heads).
    `sliding_window` is the attention window when the config enables one (Mistral v0.1, Qwen2 with
    `use_sliding_window`), else None. `moe` describes the experts of a mixture-of-experts model (None when dense).
    `linear_attention` describes the Gated DeltaNet layers of a hybrid (None when every layer attends fully);
    only the full-attention layers have KV (`num_kv_layers`, `kv_layer_id`). `partial_rotary_factor` is the share
    of each head that RoPE rotates (the first dimensions). `hf_config` keeps the raw config.json dict for anything
    else.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    bos_token_id: Optional[int]
    torch_dtype: Optional[str]
    sliding_window: Optional[int] = None
    moe: Optional[MoEConfig] = None
    linear_attention: Optional[LinearAttentionConfig] = None
    partial_rotary_factor: float = 1.0
    hf_config: dict = field(default_factory=dict, repr=False)
    # generation_config.json's sampling values (SGLang's --sampling-defaults model fills unset ones with them).
    sampling_defaults: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def model_type(self) -> str:
        return ARCHITECTURE_MODEL_TYPES[self.architecture]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers carry a recurrent state instead of KV."""
        return self.linear_attention is not None

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: all of them, except a hybrid's linear-attention layers."""
        if self.linear_attention is None:
            return self.num_hidden_layers
        return self.num_hidden_layers - len(self.linear_attention.linear_layers)

    def kv_layer_id(self, layer_id: int) -> int:
        """The KV pool's layer index of full-attention layer `layer_id` (the pool holds only those layers)."""
        if self.linear_attention is None:
            return layer_id
        return sum(1 for i in range(layer_id) if i not in self.linear_attention.linear_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict, generation_config: Optional[dict] = None) -> "ModelConfig":
        """Build from a config.json dict (and optionally generation_config.json's dict, for EOS ids).

        Raises ValueError for an unsupported architecture or an unsupported feature (non-SiLU MLP, MLP bias).
        """
        architectures = d.get("architectures") or []
        if architectures:
            architecture = architectures[0]
        else:
            architecture = _MODEL_TYPE_ARCHITECTURES.get(d.get("model_type", ""), d.get("model_type") or "<missing>")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = ARCHITECTURE_MODEL_TYPES[architecture]
        if model_type != "bert" and d.get("hidden_act", "silu") != "silu":  # BertModel checks its own
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")

        num_heads = int(d["num_attention_heads"])
        rope_theta, rope_scaling = _normalise_rope(d)
        eos_ids = _as_id_list(d.get("eos_token_id"))
        for token_id in _as_id_list((generation_config or {}).get("eos_token_id")):
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        bos = d.get("bos_token_id", (generation_config or {}).get("bos_token_id"))
        if isinstance(bos, list):
            bos = bos[0] if bos else None

        sliding_window = None
        if model_type in ("mistral", "mixtral") or (
                model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and d.get("use_sliding_window")):
            sliding_window = d.get("sliding_window")

        return cls(
            architecture=architecture,
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("layer_norm_eps" if model_type == "bert" else "rms_norm_eps",
                                     _DEFAULT_RMS_EPS[model_type])),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(d, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_5_text"),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            sliding_window=None if sliding_window is None else int(sliding_window),
            moe=MoEConfig.from_dict(d, model_type) if model_type in MOE_MODEL_TYPES else None,
            linear_attention=(LinearAttentionConfig.from_dict(d) if model_type in LINEAR_ATTENTION_MODEL_TYPES
                              else None),
            partial_rotary_factor=_partial_rotary_factor(d),
            hf_config=dict(d),
            sampling_defaults=_sampling_defaults(generation_config or {}),
        )

    @classmethod
    def from_path(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Read `model_dir/config.json` and, when present, `model_dir/generation_config.json`."""
        model_dir = os.fspath(model_dir)
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {model_dir}")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        generation_config = None
        generation_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path, encoding="utf-8") as f:
                generation_config = json.load(f)
        return cls.from_dict(config, generation_config)


def _partial_rotary_factor(d: dict) -> float:
    """The rotated share of each head: under `rope_parameters` (transformers 5) or at the top level."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(d.get("partial_rotary_factor", 1.0))


def _attention_bias(d: dict, model_type: str) -> bool:
    """Whether q/k/v carry biases: always for Qwen2 and BERT (whatever the config says), `qkv_bias` (default true) for
    Qwen2-MoE, `attention_bias` for the others."""
    if model_type in ("qwen2", "bert"):
        return True
    if model_type == "qwen2_moe":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", False))


SAMPLING_DEFAULT_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                         "repetition_penalty": float}


def _sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float]:
    """The sampling values a generation_config.json recommends (numbers only; others are ignored)."""
    found = {}
    for name, kind in SAMPLING_DEFAULT_KEYS.items():
        value = generation_config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = kind(value)
    return found
