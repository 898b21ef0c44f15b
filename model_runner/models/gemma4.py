"""Gemma 4 (text, dense): Gemma 3's layer with per-layer KV shapes, shared KV, per-layer input embeddings.

What differs from Gemma 3 (models/gemma3.py), as transformers' `Gemma4ForCausalLM` computes it:

- RMSNorm scales by `weight` itself (not `1 + weight`); values get a norm without a scale; scores are not scaled
  (the q and k norms set their size);
- the full layers have their own head_dim and KV heads (`per_layer_config`, from `global_head_dim`), so the KV pool
  holds per-layer shapes, and rotate only the first `partial_rotary_factor` of their frequencies ("proportional"
  RoPE); with `attention_k_eq_v` they have no value projection: values are the key projection's output, before
  the key norm and RoPE;
- the last `num_kv_shared_layers` layers compute no keys or values: each attends over those of the last earlier layer
  of its type, whose new tokens' K/V it passes again (rewriting the same slots with the same values) so every
  backend runs it unchanged; with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer input embeddings (`hidden_size_per_layer_input` > 0): a second embedding table gives each token a vector
  per layer, mixed with a projection of the embedded input, and each layer ends with a gated projection of its own;
- every layer's output is scaled by its `layer_scalar`.

Served on one rank; the mixture-of-experts variant (`enable_moe_block`) is refused by ModelConfig.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.layers import RotaryEmbedding
from radixserve.model_runner.parallel import TPGroup, lm_logits

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.model_config import ModelConfig


class Gemma4RMSNorm(nn.Module):
    """`x / rms(x) * weight` (no weight with `with_scale=False`), in float32, cast to x's dtype at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.to(x.dtype)


def kv_producers(config: "ModelConfig") -> dict[int, int]:
    """Layer -> the earlier layer whose keys and values it attends over, for the last `num_kv_shared_layers` layers:
    the last layer of the same kind (sliding or full) before them."""
    num_layers = config.num_hidden_layers
    first_shared = num_layers - int(config.hf_config.get("num_kv_shared_layers") or 0)
    producers = {}
    for layer in range(first_shared, num_layers):
        same_kind = [i for i in range(first_shared) if config.window_of(i) == config.window_of(layer)]
        if not same_kind:
            raise ValueError(f"layer {layer} shares the KV of an earlier layer of its kind, and there is none")
        producers[layer] = same_kind[-1]
    return producers


class Gemma4Attention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, shares_kv: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = config.kv_shape_of(layer_id)
        self.sliding_window = config.window_of(layer_id)
        self.rotary = rotary
        self.shares_kv = shares_kv
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not shares_kv:
            self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            keys_are_values = bool(config.hf_config.get("attention_k_eq_v")) and self.sliding_window is None
            self.v_proj = None if keys_are_values else nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn_backend: "AttentionBackend", shared: dict[int, tuple]) -> torch.Tensor:
        """`shared` maps a producer layer to its (layer id, keys, values) of this batch's new tokens: this layer adds
        its own, or attends over its producer's."""
        q = self.q_norm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
        if self.shares_kv:
            kv_layer, k, v = shared[self.layer_id]
            q, _ = self.rotary(positions, q, k)  # the producer's keys are rotated already; their copy is dropped
        else:
            k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, q, self.k_norm(k))
            v = self.v_norm(v)
            kv_layer = self.layer_id
            shared[self.layer_id] = (kv_layer, k, v)
        out = attn_backend.forward(q, k, v, kv_layer, 1.0, batch, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class Gemma4MLP(nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, shares_kv: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_id, rotary, shares_kv)
        wide = shares_kv and bool(config.hf_config.get("use_double_wide_mlp"))
        self.mlp = Gemma4MLP(hidden, config.intermediate_size * (2 if wide else 1))
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.per_layer_size = int(config.hf_config.get("hidden_size_per_layer_input") or 0)
        if self.per_layer_size:
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer_size, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, per_layer_input: Optional[torch.Tensor],
                batch: ForwardBatch, attn_backend: "AttentionBackend", shared: dict[int, tuple]) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), batch, attn_backend, shared)
        hidden = hidden + self.post_attention_layernorm(attended)
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        if self.per_layer_size:
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: "ModelConfig", max_positions: int) -> None:
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_scale = hidden ** 0.5
        full_dim = max(config.kv_shape_of(i)[1] for i in range(config.num_hidden_layers)
                       if config.window_of(i) is None) if None in config.layer_windows else config.head_dim
        sliding_dim = config.head_dim
        full_rotary = RotaryEmbedding(full_dim, max_positions, config.rope_theta, config.rope_scaling)
        sliding_rotary = RotaryEmbedding(sliding_dim, max_positions, config.sliding_rope_theta or config.rope_theta,
                                         config.sliding_rope_scaling)
        self.kv_producers = kv_producers(config)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, full_rotary if config.window_of(i) is None else sliding_rotary,
                               i in self.kv_producers)
            for i in range(config.num_hidden_layers))
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.per_layer_size = int(hf.get("hidden_size_per_layer_input") or 0)
        if self.per_layer_size:
            layers_width = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = nn.Embedding(int(hf.get("vocab_size_per_layer_input") or config.vocab_size),
                                                       layers_width)
            self.per_layer_model_projection = nn.Linear(hidden, layers_width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                attn_backend: "AttentionBackend") -> torch.Tensor:
        hidden = _scaled(self.embed_tokens(input_ids), self.embed_scale)
        per_layer = self._per_layer_inputs(input_ids, hidden)
        shared: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers):
            if i in self.kv_producers:
                shared[i] = shared[self.kv_producers[i]]
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, i], batch, attn_backend,
                           shared)
        return self.norm(hidden)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> Optional[torch.Tensor]:
        """`[tokens, layers, per_layer_size]`: the token's own per-layer embedding and a projection of its embedded
        input, averaged (scaled by 1/sqrt(2)); None without per-layer inputs."""
        if not self.per_layer_size:
            return None
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        own = _scaled(self.embed_tokens_per_layer(input_ids), self.per_layer_size ** 0.5).view(shape)
        projected = self.per_layer_model_projection(embedded) * (embedded.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + own) * (2.0 ** -0.5)


def _scaled(embedded: torch.Tensor, scale: float) -> torch.Tensor:
    """Embeddings times `scale` rounded to their dtype first, as transformers' scaled embeddings do."""
    return embedded * torch.tensor(scale, dtype=embedded.dtype)


class Gemma4ForCausalLM(nn.Module):
    """Causal LM over `Gemma4Model`: the runner's model interface (`forward`, `compute_logits`, `load_weights`)."""

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        if self.tp.size > 1:
            raise ValueError("Gemma 4 is served on one rank; tensor parallelism is not supported for it")
        self.config = config
        self.model = Gemma4Model(config, max_positions or config.max_position_embeddings)
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                       bias=False)
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping")
        self.logits_head: Optional[nn.Module] = None
        self.attn_backend: Optional["AttentionBackend"] = None

    def set_attention_backend(self, backend: "AttentionBackend") -> None:
        self.attn_backend = backend

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.attn_backend is not None, "set_attention_backend() must be called before forward()"
        return self.model(input_ids, positions, batch, self.attn_backend)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        indices = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        selected = hidden[indices]
        if self.logits_head is not None:
            logits = self.logits_head(selected)[..., : self.config.vocab_size].float()
        else:
            logits = lm_logits(selected, self.lm_head_weight, self.config.vocab_size, self.tp)
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy checkpoint tensors by their Hugging Face names. An unknown name or a shape mismatch raises ValueError;
        so does, when `strict`, a parameter left unloaded (a layer_scalar a checkpoint lacks is 1)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model expects {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        for name in params:
            if name.endswith("layer_scalar") and name not in loaded:
                params[name].data.fill_(1.0)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing and strict:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:10])}"
                             + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
