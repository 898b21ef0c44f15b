"""BERT encoders (transformers' `BertModel`): bidirectional attention over the whole prompt, for embeddings.

Post-norm layers (attention, add, LayerNorm; GELU MLP, add, LayerNorm), learned absolute positions and token type
0 for every token, as transformers runs a `BertModel` given only input ids. Every token attends to its whole
sequence, so a prompt is computed in one extend with no cached prefix (the runner gives the batch `causal=False`
and the torch_native backend; the scheduler neither chunks an encoder's prompt nor shares its KV). The module
names are the checkpoint's, so weights load by name; the pooler (`pooler.*`, a dense + tanh over the CLS token
that sentence embeddings do not use) is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.parallel import TPGroup

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.model_config import ModelConfig

_SKIPPED_PREFIXES = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        hf = config.hf_config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(int(hf.get("type_vocab_size", 2)), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)


class BertOutput(nn.Module):
    """A projection, added to the residual, then LayerNorm (BERT's post-norm)."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertOutput(config.hidden_size, config.hidden_size, config.rms_norm_eps)


class BertIntermediate(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn_backend: "AttentionBackend") -> torch.Tensor:
        projections = self.attention.self
        shape = (-1, self.num_heads, self.head_dim)
        q = projections.query(hidden).view(shape)
        k = projections.key(hidden).view(shape)
        v = projections.value(hidden).view(shape)
        attended = attn_backend.forward(q, k, v, self.layer_id, self.scaling, batch)
        hidden = self.attention.output(attended.reshape(hidden.shape), hidden)
        return self.output(F.gelu(self.intermediate.dense(hidden)), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder: `forward` gives the final hidden states `[num_tokens, hidden]` of the batch's tokens."""

    is_causal = False

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        if self.tp.size > 1:
            raise ValueError("BERT encoders run on one rank: drop --tp-size")
        if config.hf_config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported BERT hidden_act {config.hf_config['hidden_act']!r}; only 'gelu' runs")
        if config.hf_config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT's absolute position embeddings are supported")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.attn_backend: Optional["AttentionBackend"] = None

    def set_attention_backend(self, backend: "AttentionBackend") -> None:
        self.attn_backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.attn_backend is not None, "set_attention_backend() must be called before forward()"
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch, self.attn_backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("a BERT encoder embeds; it has no language-model head to generate with")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name (a `bert.` prefix, as task models save the encoder, is dropped).
        Strict: an unknown name, a shape mismatch or a parameter left unloaded raises ValueError."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in BertModel")
            tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model expects {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:10])}")
