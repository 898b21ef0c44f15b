"""The experts on the CPU: tokens sorted by expert, two grouped GEMMs, no Python loop over experts.

Each (token, slot) pair of the routing is one row. The rows are sorted by expert (stably, so an expert's rows keep
token order) and gathered from the hidden states; `F.grouped_mm` then multiplies each expert's run of rows by that
expert's weight, reading the stacked `[E, ...]` weights in place (no copy, however many experts are hit), once for
gate/up and once for down. The routing weights scale the rows in float32 and `index_add_` sums each token's top-k
rows in expert order, as Hugging Face's per-expert loop does.

Measured against that loop and against gathering each pair's expert weights for one batched matmul
(`benchmarks/moe_cpu.py`, 2 threads, best of 5 to 7 rounds, on a shared 2-core AMD EPYC whose load stayed between 8
and 30, so the large shapes' figures are rough): at the suite's tiny shape (8 experts of 32, top-2) the grouped path
took 0.09-0.41 ms from 1 to 64 tokens, 1.1-2.4x faster than the loop; at the layer shapes of Qwen3-30B-A3B and
Qwen1.5-MoE-A2.7B from 1 to 16 tokens it was faster than the loop in 10 of 12 cells (1.2-4.9x) and slower in one
(bfloat16, 4 tokens, 128 experts: 415 against 274 ms). Gathering was fastest at the tiny shape but its copy of every
pair's weights made it 1.1-6x slower than the grouped path at the real shapes.

At a few pairs (`SMALL_MAX_PAIRS`), SiLU experts without biases run in one C++ call instead
(`radixserve_cpu::small_experts`, kernels/cpu_linear.cpp): the pairs grouped by expert there, each visited expert's two
projections on the small-row linear kernel, which streams a weight about twice as fast as `F.linear` and
`F.grouped_mm` do at one row on the 2-core EPYC (30.6 against 16.5 GB/s, float32). Same sums, in the same expert
order; the activation rounded to the weights' dtype. That kernel sums each row alone, so under
`--enable-deterministic-inference` (`FusedMoE.batch_invariant`) the C++ call takes every number of pairs, and a
token's output does not depend on its batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build

from radixserve.model_runner.layer_configs import ExpertActivation
from radixserve.model_runner.layers import silu_and_mul

SILU = ExpertActivation()
# Pairs (tokens x top-k) up to which the C++ call runs the experts: a decode batch of a top-8 model up to 8 tokens.
SMALL_MAX_PAIRS = 64


def activate(gate_up: torch.Tensor, activation: ExpertActivation) -> torch.Tensor:
    """The experts' gated activation of `gate_up [..., 2I]` laid out `[gate | up]` (see `ExpertActivation`); the clamped
    SwiGLU in the order of operations Hugging Face's gpt-oss uses."""
    if activation.kind == "silu":
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order, ends)`: `order` lists the flattened (token, slot) pairs grouped by expert, in expert order;
    `ends[e]` (int32) is the end of expert e's run in it."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    return order, ends


def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor] = None,
                    w2_bias: Optional[torch.Tensor] = None, activation: ExpertActivation = SILU,
                    small_max_pairs: Optional[int] = SMALL_MAX_PAIRS) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over each token's experts `e =
    topk_ids[t, j]`, in hidden's dtype (with `activation` in place of the SiLU gate, and each projection's bias
    `w13_bias [E, 2I]` / `w2_bias [E, H]` added where given).

    `hidden [T, H]`; `w13 [E, 2I, H]` (each expert's gate rows, then its up rows); `w2 [E, H, I]`;
    `topk_weights [T, k]` (float32) and `topk_ids [T, k]`, in `[0, E]`: id E marks a pair whose expert another
    expert-parallel rank holds, which is skipped (it contributes nothing here).

    Up to `small_max_pairs` pairs (None: any number, the batch-invariant mode) the C++ call runs them where it can
    (`runs_small`), else the grouped GEMMs.
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(hidden)
    small = small_max_pairs is None or num_tokens * top_k <= small_max_pairs
    if small and runs_small(w13, w13_bias, w2_bias, activation) and cpu_build.ready():
        return torch.ops.radixserve_cpu.small_experts(hidden, w13.contiguous(), w2.contiguous(), topk_weights,
                                                      topk_ids)
    return grouped_gemm_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)


def runs_small(w13: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
               activation: ExpertActivation) -> bool:
    """Whether the C++ call can run these experts: SiLU, no biases, float32 or bfloat16 weights."""
    return w13_bias is None and w2_bias is None and activation.kind == "silu" and w13.dtype in (torch.float32,
                                                                                                torch.bfloat16)


def grouped_gemm_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor] = None,
                         w2_bias: Optional[torch.Tensor] = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """`grouped_experts` on two `F.grouped_mm`s (the module docstring), at any number of pairs."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(hidden)
    num_experts = w13.shape[0]
    order, ends = sort_by_expert(topk_ids, num_experts + 1)  # the last run: the pairs held elsewhere
    if ends[num_experts] > ends[num_experts - 1]:
        order = order[:int(ends[num_experts - 1])]
    ends = ends[:num_experts]
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    rows = hidden.index_select(0, token_of_row)
    gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    expert_of_row = None
    if w13_bias is not None or w2_bias is not None:
        expert_of_row = topk_ids.reshape(-1).index_select(0, order)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.index_select(0, expert_of_row)
    down = F.grouped_mm(activate(gate_up, activation), w2.transpose(1, 2), offs=ends)
    if w2_bias is not None:
        down = down + w2_bias.index_select(0, expert_of_row)
    weighted = down.float() * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token_of_row, weighted).to(hidden.dtype)
