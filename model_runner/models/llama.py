"""The Llama family (Llama 2/3.x, SmolLM2, Mistral), written for the paged-KV runtime.

The decoder here is also the base of the Qwen2 and Qwen3 files: they differ only in projection biases and a
per-head q/k norm. The mixture-of-experts families (models/moe_base.py) swap the feed-forward (`make_mlp`) and
extend the loader (`_expected_shards`, `_load_tensor`) for the experts. Tokens of all requests of a batch are concatenated (`[num_tokens, hidden]`, no batch
dimension); attention reads and writes the KV pool through the attention backend the runner installs.

Weights: `load_weights` takes Hugging Face tensor names. q/k/v are stacked into one `qkv_proj` and gate/up
into one `gate_up_proj`, so each layer runs two matmuls where HF runs five.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

import torch
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from radixserve.model_runner.parallel import (
    HeadLayout, RowParallelLinear, TPGroup, VocabParallelEmbedding, full_shape, lm_logits, narrow_source, split_size,
    vocab_shard,
)

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.model_config import ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        local = split_size(intermediate_size, tp, "intermediate size")
        self.gate_up_proj = nn.Linear(hidden_size, 2 * local, bias=False)
        self.down_proj = RowParallelLinear(local, hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`(forward(hidden), residual)` for `hidden, residual = norm(x, residual)`: the decoder layer's call, which a
        feed-forward may fuse with its norm (models/moe_base.py's sparse block does at decode sizes)."""
        hidden, residual = norm(x, residual)
        return self(hidden), residual


class LlamaAttention(nn.Module):
    """Self-attention with a fused QKV projection, RoPE, GQA and paged KV.

    Subclasses change `qkv_bias` / `o_bias` or override `normalize_qk` (Gemma 3's per-head norms), `rotate_qk`
    (Qwen3's per-head norms fused with RoPE) or `sink_logits` (gpt-oss's attention sinks).
    """

    qkv_bias_override: Optional[bool] = None  # None: follow config.attention_bias
    o_bias_override: Optional[bool] = None

    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads = HeadLayout.of(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads = self.heads.num_heads  # this rank's share (all of them without TP)
        self.num_kv_heads = self.heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.window_of(layer_id)
        self.rotary = rotary
        qkv_bias = config.attention_bias if self.qkv_bias_override is None else self.qkv_bias_override
        o_bias = config.attention_bias if self.o_bias_override is None else self.o_bias_override
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=o_bias, tp=tp)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to `q [T, H, D]`, `k [T, Hkv, D]` before RoPE; identity for Llama."""
        return q, k

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as attention reads them: `normalize_qk`, then RoPE (a subclass may fuse the two)."""
        return self.rotary(positions, *self.normalize_qk(q, k))

    def sink_logits(self) -> Optional[torch.Tensor]:
        """Hook: each head's attention-sink logit (float32 `[heads]`, gpt-oss), None for Llama (no sinks)."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        attn_backend: "AttentionBackend",
        rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The attention block's output at `rows` (every token when None); every token's K/V goes to the pool."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotate_qk(positions, q, k)
        out = attn_backend.forward(q, k, v, self.layer_id, self.scaling, batch, self.sliding_window,
                                   self.sink_logits())
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out if rows is None else out[rows])


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_id, rotary, tp)
        self.mlp = self.make_mlp(config, layer_id, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: "ModelConfig", layer_id: int, tp: TPGroup) -> nn.Module:
        """The feed-forward of layer `layer_id`: the dense gated MLP (the mixture-of-experts families override)."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        batch: ForwardBatch,
        attn_backend: "AttentionBackend",
        rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_out, residual)`; the caller (next layer or final norm) adds them. With `rows`, only those
        tokens' (the attention still reads and writes every token's K/V)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if rows is None:
            hidden = self.self_attn(positions, hidden, batch, attn_backend)
        else:
            hidden, residual = self.self_attn(positions, hidden, batch, attn_backend, rows), residual[rows]
        return self.mlp.forward_after_norm(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(
        self, config: "ModelConfig", layer_class: type[LlamaDecoderLayer], max_positions: int, tp: TPGroup
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(layer_class(config, i, rotary, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Every layer in one call for the batches it takes, else None: `(positions, hidden, batch, attn_backend) ->
        # (mlp_out, residual) or None` (model_runner/fused_decode.py installs it on GGUF blocks).
        self.fused_decode: Optional[Callable] = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn_backend: "AttentionBackend",
        rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final-norm hidden states of every new token, or of `rows` only: the last layer's feed-forward then runs on
        those rows alone (an earlier layer's every output feeds the next layer's K/V)."""
        hidden = self.embed_tokens(input_ids)
        if self.fused_decode is not None and rows is None:
            fused = self.fused_decode(positions, hidden, batch, attn_backend)
            if fused is not None:
                hidden, _ = self.norm(*fused)
                return hidden
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and rows is not None:
                hidden, residual = layer(positions, hidden, residual, batch, attn_backend, rows)
            else:
                hidden, residual = layer(positions, hidden, residual, batch, attn_backend)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF names of the projections that are stacked into one fused parameter: (fused name, HF name, shard index).
_STACKED_PROJECTIONS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    """Causal LM: `forward` gives final hidden states of every new token, `compute_logits` the logits of
    the positions the batch asks for.

    Construct with `max_positions` >= the longest sequence the runner will feed (it sizes the RoPE table).
    The runner installs the attention backend with `set_attention_backend` before the first forward.
    """

    layer_class: type[nn.Module] = LlamaDecoderLayer
    model_class: type[nn.Module] = LlamaModel  # built as model_class(config, layer_class, max_positions, tp)
    # (fused parameter, checkpoint projection, shard index): read by the quantized loader (model_runner/quantization/)
    stacked_projections = _STACKED_PROJECTIONS
    # Whether `forward` takes `rows` (a pooling batch that reads a few tokens' final hidden states): the model class
    # is LlamaModel, whose layers run the last feed-forward on those rows only.
    selects_rows = True

    def __init__(
        self, config: "ModelConfig", max_positions: Optional[int] = None, tp: Optional[TPGroup] = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        max_positions = max_positions or config.max_position_embeddings
        self.model = self.model_class(config, self.layer_class, max_positions, self.tp)
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head = None
        else:  # this rank's (padded) vocabulary rows, as the embedding's
            rows = vocab_shard(config.vocab_size, self.tp)[2]
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        # A pre-packed LM head on the CPU when the runner installs one (bfloat16: model_runner/cpu/packed.py;
        # float32 few-row inputs: model_runner/cpu/small_batch.py); None: `lm_logits` on the plain weight.
        self.logits_head: Optional[nn.Module] = None
        self.attn_backend: Optional["AttentionBackend"] = None

    def set_attention_backend(self, backend: "AttentionBackend") -> None:
        self.attn_backend = backend

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden]` of the batch's new tokens, or `[len(rows), hidden]` of the
        token rows `rows` (int64 indices; where `selects_rows`)."""
        assert self.attn_backend is not None, "set_attention_backend() must be called before forward()"
        if rows is None:
            return self.model(input_ids, positions, batch, self.attn_backend)
        assert self.selects_rows, f"{type(self).__name__} computes every token's hidden state"
        return self.model(input_ids, positions, batch, self.attn_backend, rows)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[num_selected, vocab]` at `batch.logits_indices` (default: each request's
        last new token)."""
        indices = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        selected = hidden[indices]
        if self.logits_head is not None:
            return self.logits_head(selected)[..., : self.config.vocab_size].float()
        return lm_logits(selected, self.lm_head_weight, self.config.vocab_size, self.tp)

    # ---- weights -------------------------------------------------------------------------------
    def locate_weight(self, hf_name: str) -> tuple[str, Optional[tuple[int, int]]]:
        """The parameter that holds checkpoint tensor `hf_name` (this rank's part), and its row range there when
        the tensor is one part of a fused projection (q/k/v, gate/up)."""
        params = dict(self.named_parameters())
        for fused, part, index in _STACKED_PROJECTIONS:
            if f".{part}." in hf_name:
                target = hf_name.replace(f".{part}.", f".{fused}.")
                if target in params:
                    return target, self._fused_rows(fused, index, params[target])
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return "model.embed_tokens.weight", None
        return hf_name, None

    def _fused_rows(self, fused: str, shard: int, param: torch.Tensor) -> tuple[int, int]:
        """Row range of shard `shard` (q/k/v or gate/up) inside the fused projection `param` named `fused`."""
        if fused == "qkv_proj":
            attn = self.model.layers[0].self_attn
            sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        else:  # gate/up of whichever MLP this is (dense layers and shared experts differ in width)
            sizes = (param.shape[0] // 2,) * 2
        start = sum(sizes[:shard])
        return start, start + sizes[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy HF-named tensors into the parameters, stacking q/k/v and gate/up.

        An unknown tensor name or a shape mismatch raises ValueError; so does, when `strict` (a whole checkpoint), a
        parameter (or shard) left unloaded. `lm_head.weight` is ignored when embeddings are tied.
        """
        params = dict(self.named_parameters())
        expected = self._expected_shards(params)
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            loaded.add(self._load_tensor(hf_name, tensor, params))

        missing = sorted(f"{name}" + (f"[shard {s}]" if s >= 0 else "") for name, s in expected - loaded)
        if missing and strict:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:10])}"
                             + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int]]:
        """Every (parameter, shard) a complete checkpoint loads; shard -1 for a parameter loaded whole."""
        expected: set[tuple[str, int]] = set()
        for name in params:
            fused = next((f for f, _, _ in _STACKED_PROJECTIONS if f"{f}." in name), None)
            if fused is None:
                expected.add((name, -1))
            else:
                shards = 3 if fused == "qkv_proj" else 2
                expected.update((name, s) for s in range(shards))
        return expected

    def _load_tensor(self, hf_name: str, tensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        """Copy one checkpoint tensor (this rank's part of it) into its parameter; returns the (parameter, shard)
        it filled."""
        target, shard, rows = hf_name, -1, None
        for fused, part, index in _STACKED_PROJECTIONS:
            if f".{part}." in hf_name:
                target = hf_name.replace(f".{part}.", f".{fused}.")
                if target in params:
                    shard, rows = index, self._fused_rows(fused, index, params[target])
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
        param = params[target]
        destination = param.data if rows is None else param.data[rows[0]:rows[1]]
        expected_shape = self._full_shape(hf_name, tuple(destination.shape))
        if expected_shape != full_shape(tensor):
            raise ValueError(
                f"shape mismatch for {hf_name!r}: checkpoint {full_shape(tensor)}, "
                f"model expects {expected_shape}"
            )
        self._copy_shard(hf_name, tensor, destination)
        return target, shard

    # ---- tensor-parallel slicing of checkpoint tensors ---------------------------------------------
    def _shard_of(self, hf_name: str, local_shape: tuple[int, ...]) -> Optional[tuple[int, int, int]]:
        """(dim, start, length) of this rank's part of checkpoint tensor `hf_name`, whose part here has
        `local_shape`; None when replicated."""
        if self.tp.size == 1:
            return None
        heads = self.model.layers[0].self_attn.heads
        head_dim = self.config.head_dim
        if "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
            start, end, _ = vocab_shard(self.config.vocab_size, self.tp)
            return 0, start, end - start
        if ".q_proj." in hf_name:
            return 0, heads.q_start * head_dim, heads.num_heads * head_dim
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            return 0, heads.kv_start * head_dim, heads.num_kv_heads * head_dim
        if ".o_proj.weight" in hf_name:
            return 1, heads.q_start * head_dim, heads.num_heads * head_dim
        if ".gate_proj." in hf_name or ".up_proj." in hf_name:
            return 0, self.tp.rank * local_shape[0], local_shape[0]
        if ".down_proj." in hf_name:
            return 1, self.tp.rank * local_shape[1], local_shape[1]
        return None

    def _full_shape(self, hf_name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape that a parameter (part) of `local_shape` expects."""
        if self.tp.size == 1:
            return local_shape
        if "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
            return (self.config.vocab_size,) + local_shape[1:]
        shard = self._shard_of(hf_name, local_shape)
        if shard is None:
            return local_shape
        dim = shard[0]
        config, heads = self.config, self.model.layers[0].self_attn.heads
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            whole = config.num_key_value_heads * config.head_dim
        elif ".q_proj." in hf_name or ".o_proj." in hf_name:
            whole = heads.num_heads * self.tp.size * config.head_dim
        else:  # an MLP's intermediate dimension, split evenly
            whole = local_shape[dim] * self.tp.size
        shape = list(local_shape)
        shape[dim] = whole
        return tuple(shape)

    def _copy_shard(self, hf_name: str, tensor, destination: torch.Tensor) -> None:
        """Copy this rank's part of `tensor` (a tensor or a lazy safetensors slice) into `destination`; the
        padding rows of the last vocabulary shard are zeroed."""
        shard = self._shard_of(hf_name, tuple(destination.shape))
        if shard is None:
            destination.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor[:])
            return
        dim, start, length = shard
        destination.narrow(dim, 0, length).copy_(narrow_source(tensor, dim, start, length))
        if destination.shape[dim] > length:
            destination.narrow(dim, length, destination.shape[dim] - length).zero_()
