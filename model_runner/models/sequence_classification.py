"""Sequence classifiers (`*ForSequenceClassification`): a decoder whose last hidden state goes through a linear `score`
head, one logit per label, instead of an LM head. They pool only (model_runner/pooling.py): a request's logits come
from its last token, as transformers takes the last non-padding token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.models.llama import LlamaForCausalLM
from radixserve.model_runner.models.qwen2 import Qwen2ForCausalLM
from radixserve.model_runner.models.qwen3 import Qwen3ForCausalLM
from radixserve.model_runner.pooling import classification_labels

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.model_runner.parallel import TPGroup


class SequenceClassifierMixin:
    """Turns a `LlamaForCausalLM`-shaped decoder into a classifier: no LM head, a `score` head (replicated on every
    tensor-parallel rank: the hidden states it reads are whole)."""

    lm_head_weight = None  # no LM head, tied or not: the CPU packers make no copy for one (model_runner/cpu/)

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional["TPGroup"] = None) -> None:
        super().__init__(config, max_positions, tp)  # type: ignore[call-arg]
        self.lm_head = None
        self.tie_word_embeddings = True  # nothing to load for an LM head
        del self.logits_head  # nor a packed copy of one (model_runner/cpu/)
        num_labels = len(classification_labels(config.hf_config))
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits `[requests, labels]` of pooled last-token hidden states `[requests, hidden]`."""
        return self.score(pooled)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} classifies; it has no language-model head to generate with")


class LlamaForSequenceClassification(SequenceClassifierMixin, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassifierMixin, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifierMixin, Qwen3ForCausalLM):
    pass
