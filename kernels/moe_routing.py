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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program holds the token's row of E logits in registers; past this many experts, callers keep the torch form.
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(
    Logits, Weights, Ids,
    num_experts, top_k, stride_logits,
    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """Program (token): its top-k weights and ids; SOFTMAX_FIRST picks "softmax_topk" over "topk_softmax"."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    scores = tl.load(Logits + token * stride_logits + experts, mask=valid, other=-float("inf")).to(tl.float32)
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
    )
    return weights, ids
