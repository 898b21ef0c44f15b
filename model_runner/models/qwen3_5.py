"""Qwen3.5 (text): a hybrid of Gated DeltaNet layers (model_runner/linear_attention.py) and gated full attention.

`config.linear_attention.linear_layers` says which layers are linear (three of every four in released checkpoints);
the others attend over the paged KV cache, which holds only them (`ModelConfig.kv_layer_id`). What differs from the
Qwen3 decoder:

- every RMSNorm scales by `1 + weight` (the weights are stored centred on zero), the q/k head norms included;
- attention is gated: q_proj gives, per head, the query and a gate, and the output is `attn * sigmoid(gate)`;
- RoPE rotates only the first `partial_rotary_factor * head_dim` dimensions of each head (a quarter).

Text positions are the same on the three axes of Qwen3.5's multimodal RoPE, so plain RoPE over those dimensions is
exact for text. Linear layers keep their per-request state in the runner's `StatePool`, installed with
`set_state_pool`. Tensor parallelism is not supported for this family yet. Qwen3-Next (models/qwen3_next.py) is this
decoder with sparse feed-forward layers (`make_mlp`) and its own checkpoint layout (`_load_tensor`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.layers import RotaryEmbedding
from radixserve.model_runner.linear_attention import GatedDeltaNet
from radixserve.model_runner.models.llama import LlamaMLP
from radixserve.model_runner.parallel import TPGroup, lm_logits

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.radix_cache.state_pool import StatePool


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by `1 + weight`, in float32, with the residual add of the decoder fused as `RMSNorm` does:
    `forward(x)` is `norm(x)`, `forward(x, residual)` is `(norm(x + residual), x + residual)`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class GatedAttention(nn.Module):
    """Full attention with an output gate, per-head q/k norms and partial RoPE, over the paged KV cache."""

    def __init__(self, config: "ModelConfig", kv_layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.kv_layer_id = kv_layer_id
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        # [query and gate of each head | k | v]: HF's q_proj (query and gate interleaved per head), k_proj, v_proj.
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scaling = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn_backend: "AttentionBackend") -> torch.Tensor:
        query_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(-1, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., :self.head_dim], query_gate[..., self.head_dim:]
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self._rope(positions, q, k)
        out = attn_backend.forward(q, k, v, self.kv_layer_id, self.scaling, batch).reshape(-1, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.q_size)))

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.rotary(positions, q, k)
        r = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r].contiguous(), k[..., :r].contiguous())
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


class Qwen3_5DecoderLayer(nn.Module):
    """A linear or a gated full-attention token mixer, then the feed-forward `make_mlp` builds (dense here; Qwen3-Next's
    layers may take the sparse block)."""

    @staticmethod
    def make_mlp(config: "ModelConfig", layer_id: int, tp: TPGroup) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, tp)

    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        linear = config.linear_attention
        self.is_linear = layer_id in linear.linear_layers
        if self.is_linear:
            state_index = sum(1 for i in range(layer_id) if i in linear.linear_layers)
            self.linear_attn = GatedDeltaNet(config.hidden_size, linear, state_index, config.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(config, config.kv_layer_id(layer_id), rotary)
        self.mlp = self.make_mlp(config, layer_id, tp)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                batch: ForwardBatch, attn_backend: "AttentionBackend",
                state_pool: "StatePool") -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, batch, state_pool)
        else:
            hidden = self.self_attn(positions, hidden, batch, attn_backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# HF names of the projections stacked into one parameter: (HF part, fused parameter, row range from the sizes).
_FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0), "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", 2), "linear_attn.in_proj_a": ("linear_attn.in_proj", 3),
}


class Qwen3_5ForCausalLM(nn.Module):
    """The hybrid causal LM. Same interface as `LlamaForCausalLM` (forward, compute_logits, load_weights), plus
    `set_state_pool`: the runner installs its state pool before the first forward."""

    layer_class: type[Qwen3_5DecoderLayer] = Qwen3_5DecoderLayer

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        if self.tp.size > 1:
            raise ValueError(f"{config.architecture} does not run tensor-parallel yet; use --tp-size 1")
        if config.linear_attention is None:
            raise ValueError(f"{config.architecture} needs its linear-attention layout in config.json")
        self.config = config
        max_positions = max_positions or config.max_position_embeddings
        rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i, rotary, self.tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: Optional[nn.Module] = None  # see LlamaForCausalLM
        self.attn_backend: Optional["AttentionBackend"] = None
        self.state_pool: Optional["StatePool"] = None

    def set_attention_backend(self, backend: "AttentionBackend") -> None:
        self.attn_backend = backend

    def set_state_pool(self, pool: "StatePool") -> None:
        self.state_pool = pool

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden]` of the batch's new tokens."""
        assert self.attn_backend is not None and self.state_pool is not None, (
            "set_attention_backend() and set_state_pool() must be called before forward()")
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch, self.attn_backend, self.state_pool)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits at `batch.logits_indices` (default: each request's last new token)."""
        indices = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        selected = hidden[indices]
        if self.logits_head is not None:
            return self.logits_head(selected)[..., : self.config.vocab_size].float()
        return lm_logits(selected, self.lm_head_weight, self.config.vocab_size, self.tp)

    # ---- weights -------------------------------------------------------------------------------
    def _fused_rows(self, layer: Qwen3_5DecoderLayer, fused: str, index: int) -> tuple[int, int]:
        if fused == "self_attn.qkv_proj":
            attn = layer.self_attn
            sizes = [2 * attn.q_size, attn.kv_size, attn.kv_size]
        elif fused.endswith("gate_up_proj"):  # the dense MLP's or the shared expert's
            sizes = [layer.get_submodule(fused).weight.shape[0] // 2] * 2
        else:
            lin = layer.linear_attn
            sizes = [lin.conv_dim, lin.value_size, lin.num_v_heads, lin.num_v_heads]
        start = sum(sizes[:index])
        return start, start + sizes[index]

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model loads, by Hugging Face name, with its shape (dummy weights)."""
        shapes: dict[str, tuple[int, ...]] = {}
        params = dict(self.named_parameters())
        fused_names = {fused: part for part, (fused, _) in _FUSED_PARTS.items()}
        for name, param in params.items():
            hf = "model." + name if not name.startswith("lm_head") else name
            local = name.split(".", 2)[-1] if name.startswith("layers.") else name
            if name.startswith("layers.") and any(local.startswith(f) for f in fused_names):
                layer_id = int(name.split(".")[1])
                for part, (fused, index) in _FUSED_PARTS.items():
                    if local.startswith(fused):
                        start, end = self._fused_rows(self.layers[layer_id], fused, index)
                        shapes[f"model.layers.{layer_id}.{part}.{local.rsplit('.', 1)[1]}"] = (
                            (end - start,) + tuple(param.shape[1:]))
                continue
            if local == "linear_attn.conv_weight":
                hf = hf.replace("linear_attn.conv_weight", "linear_attn.conv1d.weight")
                shapes[hf] = (param.shape[0], 1, param.shape[1])
                continue
            shapes[hf] = tuple(param.shape)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy HF-named tensors into the parameters, stacking the fused projections; ValueError for an unknown
        name, a shape mismatch or (when `strict`) a tensor the checkpoint lacks. The released checkpoints' `mtp.*`
        tensors (a multi-token-prediction head) are passed over, as transformers does."""
        params = dict(self.named_parameters())
        expected = set(self.hf_weight_shapes())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or (hf_name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if hf_name.startswith("mtp."):  # the multi-token-prediction head: a draft model, not served yet
                continue
            self._load_tensor(hf_name, tensor if isinstance(tensor, torch.Tensor) else tensor[:], params)
            loaded.add(hf_name)
        missing = sorted(expected - loaded)
        if missing and strict:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:10])}"
                             + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))

    def _load_tensor(self, hf_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> None:
        """Copy one checkpoint tensor into its parameter (its rows there, for a part of a fused projection)."""
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        target, rows = name, None
        if name.startswith("layers."):
            _, layer_id, local = name.split(".", 2)
            layer = self.layers[int(layer_id)]
            for part, (fused, index) in _FUSED_PARTS.items():
                if local.startswith(part + "."):
                    target = f"layers.{layer_id}.{fused}.{local.rsplit('.', 1)[1]}"
                    rows = self._fused_rows(layer, fused, index)
                    break
            else:
                if local == "linear_attn.conv1d.weight":
                    target = f"layers.{layer_id}.linear_attn.conv_weight"
                    tensor = tensor.reshape(tensor.shape[0], tensor.shape[-1])
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
        destination = params[target].data if rows is None else params[target].data[rows[0]:rows[1]]
        copy_checked(hf_name, tensor, destination)


def copy_checked(hf_name: str, tensor: torch.Tensor, destination: torch.Tensor) -> None:
    """`destination.copy_(tensor)`, or ValueError naming the checkpoint tensor when the shapes differ."""
    if tuple(destination.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, "
                         f"model expects {tuple(destination.shape)}")
    destination.copy_(tensor)
