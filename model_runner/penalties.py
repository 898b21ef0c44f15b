"""Per-request edits of the raw logits before sampling: penalties, logit bias and banned tokens.

`LogitAdjustments.build` turns a batch's sampling parameters and token histories into tensors, and
only for the rows that need each edit, so a batch without penalties carries nothing and costs nothing.
`LogitAdjustments.apply` edits the logits in place, in this order:

1. repetition penalty (HF / CTRL) over the tokens seen in the prompt or the output so far:
   `logit / penalty` where `logit > 0`, else `logit * penalty`. It comes first because its effect
   depends on the sign of the model's own logit, which the additive edits below would shift;
2. frequency and presence penalties (OpenAI) over the output tokens so far:
   `logit -= frequency * count + presence * (count > 0)`;
3. logit bias: `logit += bias[token]`;
4. banned tokens (EOS / stop ids while a request is below `min_new_tokens`): `logit = -inf`. Last, so
   no other edit can bring a banned token back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixserve.runtime.wire.messages import SamplingParams


def _flat_ids(id_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate token id lists (checked on entry to be inside the vocabulary) into (row index, token id)
    int64 CPU tensors."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(id_lists), dtype=torch.int64), lengths)
    return rows, flat


def history_counts(
    rows: Sequence[int], id_lists: Sequence[Sequence[int]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of some rows' token histories, with how often each occurs.

    `id_lists[j]` is the history of batch row `rows[j]`. Returns CPU int64 tensors (rows, token ids,
    counts), sorted by row then token. Sparse on purpose: a history has hundreds of distinct tokens,
    the vocabulary 50k-150k, so editing only these pairs costs O(history) instead of O(rows x vocab).
    """
    local_rows, flat = _flat_ids(id_lists)
    batch_rows = torch.tensor(list(rows), dtype=torch.int64)[local_rows]
    keys, counts = torch.unique(batch_rows * vocab_size + flat, sorted=True, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


@dataclass
class LogitAdjustments:
    """The edits of one batch, each present only when some row needs it (see the module docstring).

    Every edit is a list of (batch row, token id) pairs with a per-pair value, so applying it touches
    only those logits. Penalty pairs are distinct, so each logit is edited once per kind.
    """

    repetition_rows: Optional[torch.Tensor] = None  # [n_rep] int64: one pair per distinct seen token
    repetition_ids: Optional[torch.Tensor] = None  # [n_rep] int64
    repetition_penalties: Optional[torch.Tensor] = None  # [n_rep]: the row's repetition_penalty
    additive_rows: Optional[torch.Tensor] = None  # [n_add] int64: one pair per distinct output token
    additive_ids: Optional[torch.Tensor] = None  # [n_add] int64
    additive_amounts: Optional[torch.Tensor] = None  # [n_add]: frequency * count + presence
    bias_rows: Optional[torch.Tensor] = None  # [n_bias] int64
    bias_ids: Optional[torch.Tensor] = None  # [n_bias] int64
    bias_values: Optional[torch.Tensor] = None  # [n_bias]
    banned_rows: Optional[torch.Tensor] = None  # [n_ban] int64
    banned_ids: Optional[torch.Tensor] = None  # [n_ban] int64

    @property
    def need_penalties(self) -> bool:
        return self.repetition_rows is not None or self.additive_rows is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        prompt_ids: Optional[Sequence[Sequence[int]]] = None,
        banned_token_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> Optional["LogitAdjustments"]:
        """The edits for a batch, or None when no row needs any.

        `prompt_ids` is required when some row has `repetition_penalty != 1`. Token ids out of
        `[0, vocab_size)` (in histories, logit_bias keys or banned ids) and non-finite penalties or
        biases raise ValueError: the API layer validates first, this is the last line of defence.
        The pairs are computed on the host and copied to `device` once.
        """
        adj = cls()
        found = False

        def to_device(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device)

        repetition = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repetition:
            if prompt_ids is None:
                raise ValueError("prompt_ids are required when a request has repetition_penalty != 1")
            histories = [list(prompt_ids[i]) + list(output_ids[i]) for i in repetition]
            rows, ids, _ = history_counts(repetition, histories, vocab_size)
            per_row = torch.tensor([p.repetition_penalty for p in params], dtype=dtype)
            adj.repetition_rows, adj.repetition_ids = to_device(rows), to_device(ids)
            adj.repetition_penalties = to_device(per_row[rows])
            found = True

        additive = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if additive:
            rows, ids, counts = history_counts(additive, [output_ids[i] for i in additive], vocab_size)
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype)
            amounts = frequency[rows] * counts.to(dtype) + presence[rows]  # every pair has count > 0
            adj.additive_rows, adj.additive_ids = to_device(rows), to_device(ids)
            adj.additive_amounts = to_device(amounts)
            found = True

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(int(token))
                bias_values.append(float(bias))
        if bias_rows:
            adj.bias_rows = torch.tensor(bias_rows, dtype=torch.int64, device=device)
            adj.bias_ids = torch.tensor(bias_ids, dtype=torch.int64, device=device)
            adj.bias_values = torch.tensor(bias_values, dtype=dtype, device=device)
            found = True

        if banned_token_ids is not None and any(banned_token_ids):
            if len(banned_token_ids) != len(params):
                raise ValueError("banned_token_ids must have one list per request")
            rows, ids = _flat_ids(banned_token_ids)
            adj.banned_rows, adj.banned_ids = to_device(rows), to_device(ids)
            found = True

        return adj if found else None

    def apply(self, logits: torch.Tensor) -> None:
        """Edit `logits [bs, vocab]` in place, in the order given in the module docstring."""
        if self.repetition_rows is not None:
            where = (self.repetition_rows, self.repetition_ids)
            seen = logits[where]
            penalties = self.repetition_penalties.to(logits.dtype)
            logits[where] = torch.where(seen > 0, seen / penalties, seen * penalties)
        if self.additive_rows is not None:
            where = (self.additive_rows, self.additive_ids)
            logits[where] = logits[where] - self.additive_amounts.to(logits.dtype)
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias_values.to(logits.dtype), accumulate=True)
        if self.banned_rows is not None:
            neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
            logits.index_put_((self.banned_rows, self.banned_ids), neg_inf)
