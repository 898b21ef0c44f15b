"""Pooling: what a model serves besides text, and the vectors it pools from final hidden states.

`PoolingSpec.of` decides once, at load, what a model serves (runtime/wire/pooling.py names the kinds):

- a decoder served with `--is-embedding`: `embed`, pooled by `pooling_method`;
- an encoder (BERT, as transformers' `BertModel`): `embed`, pooled by `pooling_method` (cls unless told);
- a `*ForSequenceClassification`: `classify` (its head on the last token's hidden state);
- any other decoder (a generative model): `score` (next-token log-probabilities, no pooling).

Without `--pooling-method`, the method comes from the sentence-transformers pooling config beside the weights
(`modules.json` naming a `sentence_transformers.models.Pooling` folder, whose `config.json` sets one
`pooling_mode_*` true), as Qwen3-Embedding and the BERT-family embedders ship it.

A pooling request may be computed in chunks (chunked prefill) and on top of a cached prefix (last-token
pooling only: the hidden states of a cached prefix are not kept). `pool_hidden` therefore returns each entry's
share of the batch, which the scheduler gathers (scheduler/pooling.py): the last token's hidden state (`last`:
the final chunk's wins), the sum over the entry's new tokens (`mean`: summed over the chunks, divided by the prompt
length at the end), or the first token's hidden state when the entry starts the prompt (`cls`), else zeros.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingSpec:
    """What a loaded model serves: the pooling kinds, how an embedding pools (None unless it serves `embed`),
    its classification labels (in id order; empty unless it serves `classify`) and whether it generates."""

    kinds: tuple[str, ...]
    method: Optional[str]
    labels: tuple[str, ...]
    is_generation: bool

    @property
    def reuses_prefix(self) -> bool:
        """Whether a pooling request may start from a cached prefix: only the last token's state is needed."""
        return self.method in (None, "last")

    @classmethod
    def of(cls, model_dir: str, hf_config: dict, is_causal: bool, is_classifier: bool, is_embedding: bool,
           method: Optional[str]) -> "PoolingSpec":
        if is_classifier:
            if method not in (None, "last"):
                raise ValueError(f"a sequence classifier pools the last token; --pooling-method {method} cannot apply")
            return cls(("classify",), None, classification_labels(hf_config), is_generation=False)
        if not is_causal or is_embedding:
            method = method or sentence_transformers_pooling(model_dir) or ("last" if is_causal else "cls")
            return cls(("embed",), method, (), is_generation=False)
        if method is not None:
            raise ValueError("--pooling-method applies to embedding models: add --is-embedding")
        return cls(("score",), None, (), is_generation=True)


def classification_labels(hf_config: dict) -> tuple[str, ...]:
    """The labels of a classifier's outputs in id order (`id2label`, else LABEL_i for `num_labels`)."""
    id2label = hf_config.get("id2label") or {}
    num_labels = int(hf_config.get("num_labels") or len(id2label) or 2)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))


def sentence_transformers_pooling(model_dir: str) -> Optional[str]:
    """The pooling method of a sentence-transformers model directory, or None when it has no pooling config (or
    one with a mode radixserve does not run, which is logged)."""
    try:
        with open(os.path.join(model_dir, "modules.json"), encoding="utf-8") as f:
            modules = json.load(f)
        folder = next(m["path"] for m in modules if m.get("type", "").endswith("models.Pooling"))
        with open(os.path.join(model_dir, folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    modes = [method for key, method in _ST_POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        logger.warning("the sentence-transformers pooling config in %s sets %s; radixserve pools by one of "
                       "last, mean, cls and follows its own default", model_dir, modes or "no mode")
        return None
    return modes[0]


def pooled_rows(batch: ForwardBatch, entries: torch.Tensor, method: str) -> Optional[torch.Tensor]:
    """The token row (into the batch's concatenated new tokens) that each of `entries` pools from: its last new
    token (`last`) or its first (`cls`); None for `mean`, which reads every row."""
    if method == "mean":
        return None
    ends = torch.cumsum(batch.extend_lens, dim=0)
    if method == "last":
        return ends[entries] - 1
    if method == "cls":
        return (ends - batch.extend_lens)[entries]
    raise ValueError(f"unknown pooling method {method!r}")


def pool_hidden(hidden: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor, method: str,
                selected: bool = False) -> torch.Tensor:
    """Each of `entries`' (batch indices, int64 on the device) share of its pooled vector, `[len(entries), hidden]`
    float32 (see the module docstring). `hidden`: the final hidden states of every new token of the batch, or with
    `selected` only those of the rows `pooled_rows` names, in its order."""
    if method == "mean":
        assert not selected, "mean pooling reads every token's hidden state"
        owner = torch.repeat_interleave(torch.arange(batch.batch_size, device=hidden.device), batch.extend_lens,
                                        output_size=batch.num_tokens)
        sums = torch.zeros(batch.batch_size, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums[entries]
    rows = hidden if selected else hidden[pooled_rows(batch, entries, method)]
    if method == "cls":  # a later chunk holds no first token
        return rows.float() * (batch.prefix_lens[entries] == 0).unsqueeze(-1)
    return rows.float()
