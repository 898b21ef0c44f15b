"""Prompt-token (input) logprobs, computed in the same extend pass that prefills the prompt.

The logits at position q of a sequence are the model's distribution of its token q + 1. An extend batch
normally computes logits only at each entry's last new token (the rows the sampler reads). A batch that
must also return prompt-token logprobs carries an `InputLogprobPlan`: extra positions among its new tokens,
and for each the prompt token whose logprob it yields. The runner then computes logits at

    [last new token of entry 0, ..., last new token of entry bs-1] + plan.token_indices

(`logits_indices`), the first `bs` rows go to the sampler unchanged, and `compute_input_logprobs` turns the
rest into per-entry logprobs (and top-k alternatives). The logprobs are the plain log_softmax of the
model's logits: no penalty, bias or grammar applies to tokens the model did not choose.

Which positions a batch entry covers, and how a chunked or cached prompt is split across passes, is the
scheduler's business (scheduler/input_logprobs.py); this module only knows token indices and target ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Rows of log_softmax computed at once: bounds the float32 scratch to ROWS x vocab (about 50 MB for a
# 50k vocabulary) however long the prompt chunk is.
LOG_SOFTMAX_ROWS = 256


@dataclass
class InputLogprobPlan:
    """Extra logits rows of one batch: `token_indices[j]` indexes the batch's concatenated new tokens and
    `target_ids[j]` is the token whose logprob that row gives; rows are grouped by entry, `counts[i]` for
    batch entry i (0 when it asked for none). `top_k`: alternatives per row (0: none)."""

    token_indices: torch.Tensor  # [n] int64, host
    target_ids: torch.Tensor  # [n] int64, host
    counts: list[int]
    top_k: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.token_indices.shape[0])

    def logits_indices(self, last_token_indices: torch.Tensor) -> torch.Tensor:
        """The runner's `ForwardBatch.logits_indices`: the sampler's rows first, then the plan's."""
        extra = self.token_indices.to(last_token_indices.device, non_blocking=True)
        return torch.cat([last_token_indices, extra])


@dataclass
class InputLogprobs:
    """Per batch entry: the logprobs of its planned rows, in order, and their top-k (id, logprob) pairs."""

    logprobs: list[list[float]]
    top_logprobs: Optional[list[list[list[tuple[int, float]]]]] = None


def compute_input_logprobs(logits: torch.Tensor, plan: InputLogprobPlan) -> InputLogprobs:
    """Logprobs of `plan.target_ids` under `logits [plan.num_rows, vocab]` (rows in plan order), split by entry."""
    assert logits.shape[0] == plan.num_rows, f"{logits.shape[0]} logits rows for a plan of {plan.num_rows}"
    targets = plan.target_ids.to(logits.device)
    chosen_parts, top_value_parts, top_id_parts = [], [], []
    k = min(plan.top_k, logits.shape[1])
    for start in range(0, plan.num_rows, LOG_SOFTMAX_ROWS):
        rows = torch.log_softmax(logits[start:start + LOG_SOFTMAX_ROWS].float(), dim=-1)
        chosen_parts.append(rows.gather(1, targets[start:start + LOG_SOFTMAX_ROWS].unsqueeze(1)).squeeze(1))
        if k > 0:
            values, ids = torch.topk(rows, k, dim=-1)
            top_value_parts.append(values)
            top_id_parts.append(ids)
    chosen = torch.cat(chosen_parts).tolist() if chosen_parts else []
    tops = None
    if k > 0:
        values = torch.cat(top_value_parts).tolist() if top_value_parts else []
        ids = torch.cat(top_id_parts).tolist() if top_id_parts else []
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]

    per_entry, per_entry_top, start = [], [] if tops is not None else None, 0
    for count in plan.counts:
        per_entry.append(chosen[start:start + count])
        if tops is not None:
            per_entry_top.append(tops[start:start + count])
        start += count
    return InputLogprobs(per_entry, per_entry_top)
