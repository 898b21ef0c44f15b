"""The configs of a model's non-standard layers, read from its Hugging Face `config.json` by `ModelConfig`
(model_config.py): the sparse feed-forward of a mixture of experts (`MoEConfig`, with the experts' gated activation,
`ExpertActivation`) and the Gated DeltaNet layers of a hybrid (`LinearAttentionConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' gated activation over `[gate | up]`: "silu", `silu(gate) * up`; or "clamped_swiglu" (gpt-oss),
    `gate * sigmoid(alpha * gate) * (up + 1)` with the gate clamped to at most `limit` and up to `[-limit, limit]`."""

    kind: str = "silu"
    alpha: float = 1.0
    limit: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "clamped_swiglu"):
            raise ValueError(f"unknown expert activation {self.kind!r}")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts model.

    Routing (`routing`): "softmax_topk" takes the softmax over all experts, then the top `top_k` probabilities,
    divided by their sum when `renormalize` (Qwen's `norm_topk_prob`); "topk_softmax" takes the top `top_k` router
    logits and a softmax over those (Mixtral; renormalized by construction). `shared_expert_intermediate_size` > 0
    adds a dense expert that every token passes through, scaled by a sigmoid gate (Qwen2-MoE). Layers not in
    `sparse_layers` keep a dense MLP of the model's `intermediate_size`. gpt-oss's experts and router carry biases
    (`bias`) and apply a clamped SwiGLU (`activation`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    renormalize: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0
    bias: bool = False
    activation: ExpertActivation = ExpertActivation()

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
        if model_type == "gpt_oss":
            activation = ExpertActivation("clamped_swiglu", float(d.get("swiglu_alpha", 1.702)),
                                          float(d.get("swiglu_limit", 7.0)))
            return cls(num_experts, int(d["num_experts_per_tok"]), int(d["intermediate_size"]), "topk_softmax",
                       True, frozenset(range(num_layers)), bias=True, activation=activation)
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num_experts, int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]), "softmax_topk",
                   bool(d.get("norm_topk_prob", False)), sparse, int(d.get("shared_expert_intermediate_size") or 0))


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next): which layers they are and their shapes.

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
