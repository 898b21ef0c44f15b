"""Top-k routing of a mixture-of-experts layer in one Triton kernel: router logits `[T, E]` -> `(weights [T, k]
float32, expert ids [T, k] int64)`.

The rules are those of model_runner/moe/routing.py, which calls this on the GPU: "softmax_topk" (the softmax over
every expert in float32, the `top_k` largest probabilities, divided by their sum when `renormalize`) and
"topk_softmax" (the `top_k` largest logits, a softmax over those; gpt-oss's rule too, its router bias being part of
the logits). At one token the torch form of a rule is half a dozen kernels of a few microseconds each (softmax, top-k
and its sort, the renormalization's sum and division); this is one launch.

One program per token holds the token's whole row (`BLOCK_E`, E rounded up to a power of two) and picks the top-k by
`top_k` rounds of argmax, each masking out the expert it picked, so the ids come out in decreasing weight as
`torch.topk`'s do. Ties: `tl.argmax` takes the lowest index among equal maxima, so of experts with exactly equal
logits the lower id is picked first. `torch.topk` promises nothing on ties, so on exactly tied values at the k-th place
the two may pick different experts (of equal weight); on distinct values they agree. The shapes depend only on T, so
the kernel captures in CUDA graphs. Without CUDA it runs under the Triton interpreter (tests).

`route_from_hidden` also takes the router's product into the launch, for a decode step's one token: programs over
blocks of experts and splits of the hidden features write float32 partial logits, and the last to finish adds them
(kernels/split_k.py's `last_to_arrive`), adds the bias and applies the same rule. `add_norm_route` takes the
post-attention residual add and RMSNorm into that launch as well: each program normalizes the row for its share of the
features, and one of them writes the normalized row and the sum for the experts and the next layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_norm import residual_sum, scaled_norm
from radixserve.kernels.pdl import launch_options, wait_previous
from radixserve.kernels.split_k import last_to_arrive, split_counters

# A program holds the token's row of E logits in registers; past this many experts, callers keep the torch form.
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(
    Logits, Weights, Ids,
    num_experts, top_k, stride_logits,
    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token): its top-k weights and ids; SOFTMAX_FIRST picks "softmax_topk" over "topk_softmax"."""
    wait_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    scores = tl.load(Logits + token * stride_logits + experts, mask=valid, other=-float("inf")).to(tl.float32)
    _store_topk(scores, valid, experts, Weights, Ids, token, top_k, BLOCK_TOPK, SOFTMAX_FIRST, RENORMALIZE)


@triton.jit
def _store_topk(scores, valid, experts, Weights, Ids, token, top_k, BLOCK_TOPK: tl.constexpr,
                SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The rule on one token's float32 logits `scores` (-inf where not `valid`): its weights and ids stored at row
    `token` of Weights / Ids."""
    if SOFTMAX_FIRST:
        exp = tl.where(valid, tl.exp(scores - tl.max(scores, axis=0)), 0.0)
        scores = tl.where(valid, exp / tl.sum(exp, axis=0), -float("inf"))
    slots = tl.arange(0, BLOCK_TOPK)
    picked_scores = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int64)
    for slot in range(0, top_k):
        best = tl.argmax(scores, axis=0, tie_break_left=True)
        best_score = tl.max(scores, axis=0)
        picked_scores = tl.where(slots == slot, best_score, picked_scores)
        picked_ids = tl.where(slots == slot, best.to(tl.int64), picked_ids)
        scores = tl.where(experts == best, -float("inf"), scores)
    in_top_k = slots < top_k
    if SOFTMAX_FIRST:
        weights = picked_scores
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(in_top_k, weights, 0.0), axis=0)
    else:
        exp = tl.where(in_top_k, tl.exp(picked_scores - tl.max(tl.where(in_top_k, picked_scores, -float("inf")),
                                                                 axis=0)), 0.0)
        weights = exp / tl.sum(exp, axis=0)
    tl.store(Weights + token * top_k + slots, weights, mask=in_top_k)
    tl.store(Ids + token * top_k + slots, picked_ids, mask=in_top_k)


@triton.jit
def _router_route_kernel(
    X, W, Bias, Partial, Counters, Weights, Ids, Residual, Norm_weight, Hidden_out, Residual_out,
    num_experts, hidden, top_k, stride_we, eps,
    HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ALL_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (block of BLOCK_E experts, K split): the token's router logits for its experts over its share of the
    hidden features, to its split's row of Partial `[splits, experts]` (float32); the last program to arrive
    (kernels/split_k.py's `last_to_arrive`) adds the splits, adds the bias and routes. The router weight `[E, hidden]`
    is read once, by programs enough to stream it.

    With HAS_NORM, X is the attention block's output and the router reads RMSNorm(X + Residual) * Norm_weight, with
    kernels/fused_norm.py's roundings (the sum and the normalized row rounded to X's dtype): each program loads the
    whole row (BLOCK_H, the hidden size rounded up to a power of two) for its statistics after issuing its weight
    tile's load (one K tile a program), and program (0, 0) also writes the normalized row and the sum to Hidden_out
    and Residual_out."""
    wait_previous(USE_PDL)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    if HAS_NORM:
        k = tl.program_id(1) * BLOCK_K + ks
        k_ok = k < hidden
        w = tl.load(W + experts[:, None] * stride_we + k[None, :], mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
        act_dtype = X.dtype.element_ty
        row = tl.arange(0, BLOCK_H)
        row_ok = row < hidden
        summed = residual_sum(tl.load(X + row, mask=row_ok, other=0.0), tl.load(Residual + row, mask=row_ok, other=0.0),
                              act_dtype)
        rstd = tl.rsqrt(tl.sum(summed * summed, axis=0) / hidden + eps)
        if tl.program_id(0) + tl.program_id(1) == 0:  # program (0, 0)
            tl.store(Residual_out + row, summed.to(act_dtype), mask=row_ok)
            norm_w = tl.load(Norm_weight + row, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(Hidden_out + row, scaled_norm(summed, rstd, norm_w, act_dtype).to(act_dtype), mask=row_ok)
        x = residual_sum(tl.load(X + k, mask=k_ok, other=0.0), tl.load(Residual + k, mask=k_ok, other=0.0), act_dtype)
        x = scaled_norm(x, rstd, tl.load(Norm_weight + k, mask=k_ok, other=0.0).to(tl.float32), act_dtype)
        acc += tl.sum(w.to(tl.float32) * x.to(act_dtype).to(tl.float32)[None, :], axis=1)
    else:
        k_tiles = tl.cdiv(hidden, BLOCK_K)
        per_split = tl.cdiv(k_tiles, tl.num_programs(1))
        first = tl.program_id(1) * per_split
        for tile in range(first, tl.minimum(first + per_split, k_tiles)):
            k = tile * BLOCK_K + ks
            k_ok = k < hidden
            w = tl.load(W + experts[:, None] * stride_we + k[None, :], mask=expert_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x = tl.load(X + k, mask=k_ok, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(Partial + tl.program_id(1) * num_experts + experts, acc, mask=expert_ok)
    if last_to_arrive(Counters, tl.num_programs(0) * tl.num_programs(1)):
        all_experts = tl.arange(0, ALL_E)
        valid = all_experts < num_experts
        # Every split's row in one load (BLOCK_SPLITS: the split count rounded up to a power of two), so the loads
        # wait on the L2 together; the sum's order is fixed by the shapes.
        splits = tl.arange(0, BLOCK_SPLITS)
        rows = tl.load(Partial + splits[:, None] * num_experts + all_experts[None, :],
                       mask=(splits < tl.num_programs(1))[:, None] & valid[None, :], other=0.0, cache_modifier=".cg")
        scores = tl.sum(rows, axis=0)
        if HAS_BIAS:
            scores += tl.load(Bias + all_experts, mask=valid, other=0.0).to(tl.float32)
        scores = tl.where(valid, scores, -float("inf"))
        _store_topk(scores, valid, all_experts, Weights, Ids, 0, top_k, BLOCK_TOPK, SOFTMAX_FIRST, RENORMALIZE)
        tl.store(Counters, 0)  # for the next call


def route_topk(router_logits: torch.Tensor, top_k: int, routing: str,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [T, top_k] float32, expert ids [T, top_k] int64)` of router logits `[T, E]` (any float dtype) by
    `routing`, "softmax_topk" (with `renormalize`) or "topk_softmax" (renormalized by construction); each row of ids
    in decreasing weight. `E <= MAX_EXPERTS`."""
    if routing not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"unknown MoE routing {routing!r}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the routing kernel takes at most {MAX_EXPERTS} experts, got {num_experts}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, top_k, router_logits.stride(0),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOPK=triton.next_power_of_2(top_k),
        SOFTMAX_FIRST=routing == "softmax_topk", RENORMALIZE=renormalize,
        num_warps=1 if num_experts <= 256 else 4,  # one warp's shuffles reduce a row of up to 256 without a barrier
        **launch_options(router_logits),
    )
    return weights, ids


# The tokens `route_from_hidden` takes: one, a decode step's at batch 1. At one token of Qwen3-30B-A3B on an H100 it
# ran 6.4 us a layer against 5.0 + 2.5 for the router's GEMM and `route_topk`. A form that looped over eight tokens
# in each program (and routed them one after another) made the batch-8 step 1.2 ms slower than the two kernels (with
# the skinny 16-bit linears too; two calls on H100s): more tokens take the two.
FUSED_MAX_TOKENS = 1


def route_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
                      routing: str, renormalize: bool, block_e: int = 32, block_k: int = 256,
                      splits: int = 8, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk(hidden @ weight.T + bias, ...)` in one launch for FUSED_MAX_TOKENS token: the router's product in
    float32 (from `hidden [1, H]` and `weight [E, H]` in their dtype), then the rule. The logits are the product's
    float32 sums, not a 16-bit GEMM's rounded output, so on near ties the pick may differ from `route_topk` on the
    GEMM's logits."""
    weights, ids = _route_outputs(hidden, weight, top_k, routing)
    splits = max(1, min(splits, triton.cdiv(hidden.shape[1], block_k)))
    _launch_router(hidden, weight, bias, top_k, routing, renormalize, weights, ids, None, block_e, block_k, splits,
                   num_warps)
    return weights, ids


def add_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, routing: str, renormalize: bool,
                   block_e: int = 32, block_k: int = 256, num_warps: int = 4
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm(x, residual, norm_weight, eps)` and `route_from_hidden` on its output in one launch, for
    FUSED_MAX_TOKENS token: `(weights, ids, normalized [1, H], x + residual [1, H])`, the last two as
    kernels/fused_norm.py rounds them (x, residual and norm_weight in one 16-bit dtype). The decode step's
    post-attention norm of a mixture-of-experts layer: its launch and hand-over go."""
    weights, ids = _route_outputs(x, weight, top_k, routing)
    assert residual.shape == x.shape and residual.dtype == x.dtype == norm_weight.dtype and residual.stride(1) == 1
    assert norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous()
    hidden, summed = torch.empty_like(x), torch.empty_like(x)
    _launch_router(x, weight, bias, top_k, routing, renormalize, weights, ids, (residual, norm_weight, hidden, summed,
                   eps), block_e, block_k, triton.cdiv(x.shape[1], block_k), num_warps)
    return weights, ids, hidden, summed


def _route_outputs(hidden: torch.Tensor, weight: torch.Tensor, top_k: int,
                   routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks of the fused router's launch and its empty `(weights, ids)`."""
    if routing not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"unknown MoE routing {routing!r}")
    num_tokens, hidden_size = hidden.shape
    num_experts = weight.shape[0]
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS or num_tokens != FUSED_MAX_TOKENS:
        raise ValueError(f"route_from_hidden takes {FUSED_MAX_TOKENS} token and 1 <= top_k <= experts <= "
                         f"{MAX_EXPERTS}; got {num_tokens} tokens, top_k {top_k}, {num_experts} experts")
    assert weight.shape[1] == hidden_size and weight.stride(1) == 1 and hidden.stride(1) == 1
    return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=hidden.device),
            torch.empty(num_tokens, top_k, dtype=torch.int64, device=hidden.device))


def _launch_router(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, routing: str,
                   renormalize: bool, weights: torch.Tensor, ids: torch.Tensor, norm: Optional[tuple], block_e: int,
                   block_k: int, splits: int, num_warps: int) -> None:
    """`_router_route_kernel` over (expert blocks, splits); `norm`: `(residual, norm weight, normalized out, sum out,
    eps)` or None."""
    num_experts, hidden_size = weight.shape
    partial = torch.empty(splits, num_experts, dtype=torch.float32, device=x.device)
    residual, norm_weight, hidden_out, summed_out, eps = norm if norm is not None else (x, x, x, x, 0.0)
    _router_route_kernel[(triton.cdiv(num_experts, block_e), splits)](
        x, weight, weight if bias is None else bias, partial, split_counters(x.device, 1), weights, ids,
        residual, norm_weight, hidden_out, summed_out,
        num_experts, hidden_size, top_k, weight.stride(0), eps,
        HAS_BIAS=bias is not None, BLOCK_E=block_e, BLOCK_K=block_k, ALL_E=triton.next_power_of_2(num_experts),
        BLOCK_TOPK=triton.next_power_of_2(top_k), SOFTMAX_FIRST=routing == "softmax_topk", RENORMALIZE=renormalize,
        BLOCK_SPLITS=triton.next_power_of_2(splits), HAS_NORM=norm is not None,
        BLOCK_H=triton.next_power_of_2(hidden_size) if norm is not None else 1, num_warps=num_warps,
        **launch_options(x),
    )
