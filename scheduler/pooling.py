"""Pooling requests in the scheduler: prefill-only requests that finish with a vector instead of tokens.

A pooling request (`Req.pooling`, runtime/wire/pooling.py) has `max_new_tokens = 0`: it is admitted, chunked and
batched with generation like any prompt, and finishes when its last chunk is processed (results.py), its KV going
to the tree as a finished request's does. Per batch, `PoolingBatch` names the entries that pool; the executor asks
the runner for their hidden-state shares (`embed`, `classify`) or reads their label log-probabilities off the
logits (`score`); `take_share` gathers a request's shares over its chunks and `finish_vector` turns them into the
vector sent with its finish.

Cache: a `last`-pooled request may start from a cached prefix, as a generation request does. A `mean`- or
`cls`-pooled one needs every prompt token's hidden state, so it computes its whole prompt (`reusable_prefix` is
0); its KV still goes into the tree for later requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.scheduler.req import Req


@dataclass
class PoolingBatch:
    """The entries of one batch that pool (batch indices, ascending), split by where their vector comes from."""

    hidden_entries: list[int]  # embed and classify: pooled from the final hidden states
    score_entries: list[int]  # score: label-token log-probabilities from the entry's logits row
    score_labels: list[tuple[int, ...]]  # per score entry

    @classmethod
    def of(cls, reqs: list[Req]) -> Optional["PoolingBatch"]:
        hidden, score, labels = [], [], []
        for i, req in enumerate(reqs):
            if req.pooling is None:
                continue
            if req.pooling.kind == "score":
                score.append(i)
                labels.append(req.pooling.label_token_ids)
            else:
                hidden.append(i)
        return cls(hidden, score, labels) if hidden or score else None


def reusable_prefix(req: Req, limit: int, reuses_prefix: bool) -> int:
    """How many leading tokens `req` may take from the cache: `limit`, or 0 for a pooling request that needs the
    hidden state of every prompt token (`reuses_prefix` False: the server pools by mean or CLS)."""
    return 0 if req.pooling is not None and not reuses_prefix else limit


def take_share(req: Req, share: torch.Tensor, prefix_len: int, method: Optional[str]) -> None:
    """Gather one extend's share of `req`'s vector (model_runner/pooling.py): a `mean` share is added to the earlier
    chunks' (a chunk from position 0 starts over, as after a retraction); any other replaces them, except a `cls`
    share of a later chunk, which is zeros."""
    if req.pooled is None or prefix_len == 0:
        req.pooled = share
    elif method == "mean":
        req.pooled = req.pooled + share
    elif method != "cls":
        req.pooled = share


def finish_vector(req: Req, method: Optional[str]) -> list[float]:
    """The vector sent with `req`'s finish: an embedding L2-normalized (a mean first divided by the prompt length),
    a classifier's logits and score's log-probabilities as they are."""
    assert req.pooling is not None and req.pooled is not None, f"{req.rid} finished without a pooled vector"
    vector = req.pooled.double()
    if req.pooling.kind == "embed":
        if method == "mean":
            vector = vector / req.prompt_len
        norm = float(vector.norm())
        vector = vector / norm if norm > 0 and math.isfinite(norm) else vector
    return vector.tolist()
