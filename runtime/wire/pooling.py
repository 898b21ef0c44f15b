"""Pooling requests: prefill-only requests that return a vector instead of generated tokens.

Three kinds, each served by the models that can (`ModelInfo.pooling_kinds` lists a server's):

- `embed`: the final hidden states pooled over the prompt (the server's `pooling_method`: the last token, the mean,
  or the first (CLS) token) and L2-normalized. Served by `--is-embedding` decoders and by encoders.
- `classify`: a sequence-classification head (`*ForSequenceClassification`) on the last token: one logit per label.
- `score`: SGLang's `/v1/score`: the log-probabilities, under the full vocabulary, of `label_token_ids` as the next
  token after the prompt. Served by generative models.

A pooling request travels as a generation request with `max_new_tokens = 0` and `RequestOptions.pooling` set; the
scheduler batches it with generation and returns its vector in `BatchTokenOut.embeddings`. Light module: msgspec
only.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PoolingKind = Literal["embed", "classify", "score"]
POOLING_KINDS = ("embed", "classify", "score")
# How an embedding pools the prompt's final hidden states.
POOLING_METHODS = ("last", "mean", "cls")
MAX_LABEL_TOKENS = 256


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a pooling request returns (see the module docstring)."""

    kind: PoolingKind
    label_token_ids: tuple[int, ...] = ()  # `score` only: the tokens whose log-probabilities are returned

    def check(self, vocab_size: int, served: tuple[str, ...] | list[str]) -> None:
        """ValueError when the model cannot serve this kind or the label tokens are out of range."""
        if self.kind not in served:
            can = ", ".join(served) or "none"
            raise ValueError(f"this model cannot serve {self.kind} requests (it serves: {can})")
        if self.kind == "score":
            if not 0 < len(self.label_token_ids) <= MAX_LABEL_TOKENS:
                raise ValueError(f"score needs 1 to {MAX_LABEL_TOKENS} label_token_ids, got "
                                 f"{len(self.label_token_ids)}")
            bad = [t for t in self.label_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"label_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        elif self.label_token_ids:
            raise ValueError(f"label_token_ids belong to score requests, not {self.kind}")
