"""Model configuration: the fields the runtime's model code needs, read from a Hugging Face `config.json`.

`ModelConfig` normalises the differences between config generations so model code never looks at raw keys:

- RoPE: older configs carry `rope_theta` and `rope_scaling` (scaling type under "type" or "rope_type");
  transformers 5 writes one `rope_parameters` dict holding `rope_theta` together with the scaling fields and
  `"rope_type": "default"` when there is no scaling. Both give the same `rope_theta` / `rope_scaling` here;
  `rope_scaling` is None for plain RoPE and otherwise always has a "rope_type" key.
- EOS: `eos_token_ids` is the union (config first, order kept) of `eos_token_id` in config.json and in
  generation_config.json, each of which may be an int or a list.
- Per-architecture facts: Qwen2 always has q/k/v biases (Qwen2-MoE unless `qkv_bias` says otherwise); Qwen3 and
  Qwen3-MoE always have per-head q/k RMSNorm; gpt-oss has biases on q/k/v/o unless `attention_bias` is false.
- Sliding windows: `layer_windows` holds each layer's attention window (None: full attention), from the config's
  `layer_types` where it has them (Qwen2/Qwen3 with `use_sliding_window`, Gemma 3), else the one `sliding_window` for
  every layer (Mistral, Mixtral). Per-layer-type RoPE (Gemma 3: `rope_parameters` keyed by layer type) gives the
  full layers' `rope_theta` / `rope_scaling` and the sliding layers' `sliding_rope_theta` / `sliding_rope_scaling`.
- Per-layer KV shapes: Gemma 4's full layers have their own head_dim and KV heads (`per_layer_config`);
  `layer_kv_shapes` holds each layer's (KV heads, head_dim), empty where every layer has the model's.
- Mixtures of experts: `moe` (a `MoEConfig`, layer_configs.py) holds the expert count, the routing rule and which
  layers are sparse, read from the family's own keys (`num_experts` or `num_local_experts`, `moe_intermediate_size`
  or Mixtral's `intermediate_size`); None for dense models. Hybrids: `linear_attention` (a `LinearAttentionConfig`)
  holds their Gated DeltaNet layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from radixserve.model_runner.layer_configs import LinearAttentionConfig, MoEConfig

# Architecture name -> Hugging Face model_type. The model code registers one implementation per entry.
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma4ForCausalLM": "gemma4_text",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
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
                          "qwen3_moe": 32768, "mixtral": 131072, "gemma3_text": 131072, "gemma4_text": 131072,
                          "qwen3_5_text": 32768, "gpt_oss": 131072, "qwen3_next": 32768}
_DEFAULT_RMS_EPS = {"bert": 1e-12, "llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6,
                    "mixtral": 1e-5, "gemma3_text": 1e-6, "gemma4_text": 1e-6, "qwen3_5_text": 1e-6, "gpt_oss": 1e-5,
                    "qwen3_next": 1e-6}
# The activation of the gated MLP per family that does not use SiLU, and the config key naming it.
_GELU_TANH_FAMILIES = {"gemma3_text": "hidden_activation", "gemma4_text": "hidden_activation"}
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "qwen3_next")
# Hybrids of Gated DeltaNet (linear attention) and full-attention layers.
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
# transformers' default share of each head that RoPE rotates, where a family's is not the whole head.
_DEFAULT_PARTIAL_ROTARY = {"qwen3_next": 0.25}
_DEFAULT_ROPE_THETA = 10000.0


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _normalise_rope(d: dict, layer_type: str = "full_attention") -> tuple[float, Optional[dict]]:
    """Return (rope_theta, rope_scaling) from either config generation, for the layers of `layer_type` where the
    config has per-layer-type RoPE; see the module docstring."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type) or params.get("full_attention") or next(iter(params.values()))
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


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model, normalised across config formats.

    `head_dim` is always set (explicit in the config, else hidden_size // num_attention_heads).
    `sliding_window` is the attention window when the config enables one (Mistral v0.1, Qwen2 with
    `use_sliding_window`, Gemma 3), else None; `layer_windows` says which layers use it. `moe` describes the experts
    of a mixture-of-experts model (None when dense). `linear_attention` describes the Gated DeltaNet layers of a hybrid
    (None when every layer attends fully); only the full-attention layers have KV (`num_kv_layers`, `kv_layer_id`).
    `partial_rotary_factor` is the share of each head that RoPE rotates (the first dimensions). `hf_config` keeps the
    raw config.json dict for anything else.
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
    layer_windows: tuple[Optional[int], ...] = ()  # per layer; empty: no layer has a window
    sliding_rope_theta: Optional[float] = None  # the sliding layers' RoPE where it differs by layer type
    sliding_rope_scaling: Optional[dict] = None
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()  # per layer (KV heads, head_dim); empty: all the model's
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

    def window_of(self, layer_id: int) -> Optional[int]:
        """The sliding window of layer `layer_id`, None for a full-attention layer."""
        return self.layer_windows[layer_id] if self.layer_windows else None

    def kv_shape_of(self, layer_id: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer `layer_id`, over all ranks."""
        if self.layer_kv_shapes:
            return self.layer_kv_shapes[layer_id]
        return self.num_key_value_heads, self.head_dim

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct windows of the model's layers (empty when every layer attends in full)."""
        return tuple(sorted({w for w in self.layer_windows if w is not None}))

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
        if model_type in _GELU_TANH_FAMILIES:
            key = _GELU_TANH_FAMILIES[model_type]
            if d.get(key, "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ValueError(f"unsupported {key} {d[key]!r} for {model_type}; only 'gelu_pytorch_tanh' is supported")
        elif model_type != "bert" and d.get("hidden_act", "silu") != "silu":  # BertModel checks its own
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
        if model_type in ("mistral", "mixtral", "gemma3_text", "gemma4_text", "gpt_oss") or (
                model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and d.get("use_sliding_window")):
            sliding_window = d.get("sliding_window")
        layer_windows = _layer_windows(d, None if sliding_window is None else int(sliding_window))
        sliding_rope_theta, sliding_rope_scaling = _sliding_rope(d, model_type)

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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_next"),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_windows=layer_windows,
            layer_kv_shapes=_layer_kv_shapes(d, model_type),
            sliding_rope_theta=sliding_rope_theta,
            sliding_rope_scaling=sliding_rope_scaling,
            moe=MoEConfig.from_dict(d, model_type) if model_type in MOE_MODEL_TYPES else None,
            linear_attention=(LinearAttentionConfig.from_dict(d) if model_type in LINEAR_ATTENTION_MODEL_TYPES
                              else None),
            partial_rotary_factor=_partial_rotary_factor(d, _DEFAULT_PARTIAL_ROTARY.get(model_type, 1.0)),
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


def _layer_kv_shapes(d: dict, model_type: str) -> tuple[tuple[int, int], ...]:
    """Each layer's (KV heads, head_dim) where some layer differs from the model's (Gemma 4's `per_layer_config`, keyed
    by layer index); empty otherwise. Refuses the Gemma 4 features not served here."""
    if model_type != "gemma4_text":
        return ()
    if d.get("enable_moe_block"):
        raise ValueError("Gemma 4's mixture-of-experts blocks (enable_moe_block) are not supported")
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not a causal LM")
    num_heads = int(d["num_attention_heads"])
    base = (int(d.get("num_key_value_heads") or num_heads), int(d.get("head_dim") or int(d["hidden_size"]) // num_heads))
    if "per_layer_config" in d:
        overrides = {int(layer): entry for layer, entry in (d["per_layer_config"] or {}).items()}
    else:  # as transformers derives it: the full layers' own head_dim, and KV heads where keys are values
        full = {"head_dim": d.get("global_head_dim", 512),
                "num_key_value_heads": d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None}
        overrides = {i: full for i, kind in enumerate(d.get("layer_types") or ()) if kind == "full_attention"}
    shapes = tuple((int(overrides.get(i, {}).get("num_key_value_heads") or base[0]),
                    int(overrides.get(i, {}).get("head_dim") or base[1]))
                   for i in range(int(d["num_hidden_layers"])))
    return () if all(shape == base for shape in shapes) else shapes


def _sliding_rope(d: dict, model_type: str) -> tuple[Optional[float], Optional[dict]]:
    """The sliding layers' (rope_theta, rope_scaling) where the config gives them their own RoPE: a
    `rope_parameters` entry "sliding_attention", or an older Gemma 3 config's `rope_local_base_freq` (no scaling);
    (None, None) where they rotate as the full layers."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return _normalise_rope(d, "sliding_attention")
    if model_type == "gemma3_text":
        return float(d.get("rope_local_base_freq", 10000.0)), None
    return None, None


def _layer_windows(d: dict, window: Optional[int]) -> tuple[Optional[int], ...]:
    """Each layer's window (see the module docstring); empty without one. A Gemma 3 or 4 config without
    `layer_types` has every `sliding_window_pattern`-th layer (default 6) full (and Gemma 4's last)."""
    if window is None:
        return ()
    if window < 1:
        raise ValueError(f"sliding_window must be positive, got {window}")
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if not layer_types and d.get("model_type") in ("gemma3_text", "gemma4_text"):
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
        if d.get("model_type") == "gemma4_text":  # its last layer is always full
            layer_types[-1] = "full_attention"
    if not layer_types and d.get("model_type") == "gpt_oss":  # transformers' default: sliding, full, sliding, ...
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not layer_types:
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers; the model has {num_layers}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _partial_rotary_factor(d: dict, default: float = 1.0) -> float:
    """The rotated share of each head: under `rope_parameters` (transformers 5) or at the top level."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(d.get("partial_rotary_factor", default))


def _attention_bias(d: dict, model_type: str) -> bool:
    """Whether q/k/v carry biases: always for Qwen2 and BERT (whatever the config says), `qkv_bias` (default true) for
    Qwen2-MoE, `attention_bias` for the others."""
    if model_type in ("qwen2", "bert"):
        return True
    if model_type == "qwen2_moe":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", model_type == "gpt_oss"))


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
