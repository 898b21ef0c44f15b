"""The experts on the CPU: tokens sorted by expert, two grouped GEMMs, no Python loop over experts.

Each (token, slot) pair of the routing is one row. The rows are sorted by expert (stably, so an expert's rows keep
token order) and gathered from the hidden states; `F.grouped_mm` then multiplies each expert's run of rows by that
expert's weight, reading the stacked `[E, ...]` weights in place (no copy, however many experts are hit), once for
gate/up and once for down. The routing weights scale the rows in float32 and `index_add_` sums each token's top-k
rows in expert order, as Hugging Face's per-expert loop does.

Measured against that loop and against gathering each pair's expert weights for one batched matmul in
`benchmarks/moe_cpu.py` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model_runner.layers import silu_and_mul


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order, ends)`: `order` lists the flattened (token, slot) pairs grouped by expert, in expert order;
    `ends[e]` (int32) is the end of expert e's run in it."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    return order, ends


def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over each token's experts `e =
    topk_ids[t, j]`, in hidden's dtype.

    `hidden [T, H]`; `w13 [E, 2I, H]` (each expert's gate rows, then its up rows); `w2 [E, H, I]`;
    `topk_weights [T, k]` (float32) and `topk_ids [T, k]`.
    """
    num_tokens, top_k = topk_ids.shape
    order, ends = sort_by_expert(topk_ids, w13.shape[0])
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    rows = hidden.index_select(0, token_of_row)
    gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    down = F.grouped_mm(silu_and_mul(gate_up), w2.transpose(1, 2), offs=ends)
    weighted = down.float() * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token_of_row, weighted).to(hidden.dtype)
