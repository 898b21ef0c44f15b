"""Top-k routing: which experts each token visits, and with what weight.

Two rules cover the supported families (`MoEConfig.routing`):

- "softmax_topk" (Qwen2-MoE, Qwen3-MoE): the softmax over every expert's router logit, in float32, then the `top_k`
  largest probabilities; divided by their sum when `renormalize` (`norm_topk_prob`), else used as they are (they then
  sum to less than one).
- "topk_softmax" (Mixtral): the `top_k` largest logits, then a softmax over those alone. It equals the first rule
  with renormalization up to rounding; it is the order the Mixtral paper writes.

The weights come back in float32 whatever the logits' dtype: the expert kernels multiply in float32 before they sum
the top-k outputs. On CUDA, both rules run as one Triton kernel (kernels/moe_routing.py: one launch a layer instead
of the torch form's half dozen, which at decode sizes take a few microseconds each); the CPU keeps the torch form.
The two agree on the ids wherever the logits are distinct, and on the weights to float32 rounding. Where the
kernel fails to compile (a Triton build without this device), the failure is logged once and the torch form routes.
At decode sizes `route_tokens` also folds the router's product into the kernel's launch, and
`add_norm_route_tokens` the post-attention residual add and RMSNorm before it.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.kernels.guard import KernelGuard
from radixserve.model_runner.layers import RMSNorm


def select_experts(router_logits: torch.Tensor, top_k: int, routing: str,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [T, top_k] float32, expert ids [T, top_k] int64)` for router logits `[T, num_experts]`; each row of
    ids is ordered by decreasing weight."""
    if router_logits.is_cuda and _kernel.usable:
        from radixserve.kernels.moe_routing import MAX_EXPERTS, route_topk  # CPU-only processes never import triton

        if router_logits.shape[-1] <= MAX_EXPERTS and routing in ("softmax_topk", "topk_softmax"):
            try:
                return route_topk(router_logits, top_k, routing, renormalize)
            except Exception as exc:  # a Triton build or device that cannot compile the kernel
                if not _kernel.absorb(exc):
                    raise
    return select_experts_torch(router_logits, top_k, routing, renormalize)


# kernels/moe_routing.py, turned off once it failed to compile here (first met in the warm-up, before any capture).
_kernel = KernelGuard("MoE routing's kernel", "torch ops route", errors_of_the_caller=(ValueError,))
_fused = KernelGuard("MoE routing's kernel with the router's product", "the router's GEMM and the routing kernel "
                     "route", errors_of_the_caller=(ValueError,))


def route_tokens(hidden: torch.Tensor, gate: nn.Module, top_k: int, routing: str,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(gate(hidden), ...)`. On CUDA, a decode step's one token takes the router's product and the
    rule in one launch (kernels/moe_routing.py, `route_from_hidden`: at one token of Qwen3-30B-A3B the router's GEMM
    alone ran 5 us on an H100, the routing kernel 2.5 us more); the logits are then float32 sums, not the 16-bit
    GEMM's rounded output."""
    if _one_launch(hidden, gate, routing):
        from radixserve.kernels.moe_routing import route_from_hidden

        try:
            return route_from_hidden(hidden.reshape(-1, hidden.shape[-1]), gate.weight, gate.bias, top_k, routing,
                                     renormalize)
        except Exception as exc:  # a Triton build or device that cannot compile the kernel
            if not _fused.absorb(exc):
                raise
    return select_experts(gate(hidden), top_k, routing, renormalize)


def add_norm_route_tokens(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gate: nn.Module, top_k: int,
                          routing: str, renormalize: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(hidden, residual, weights, ids)`: `hidden, residual = norm(x, residual)`, then `route_tokens(hidden, ...)`.
    Where `route_tokens` would take its one-launch form and `norm` is a plain `RMSNorm` in the activations' dtype, the
    residual add and the norm join that launch too (kernels/moe_routing.py, `add_norm_route`)."""
    if (_one_launch(x, gate, routing) and type(norm) is RMSNorm and x.dtype == residual.dtype == norm.weight.dtype
            and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()):
        from radixserve.kernels.moe_routing import add_norm_route

        try:
            weights, ids, hidden, residual = add_norm_route(x, residual, norm.weight, norm.eps, gate.weight,
                                                            gate.bias, top_k, routing, renormalize)
            return hidden, residual, weights, ids
        except Exception as exc:  # a Triton build or device that cannot compile the kernel
            if not _fused.absorb(exc):
                raise
    hidden, residual = norm(x, residual)
    return (hidden, residual) + route_tokens(hidden, gate, top_k, routing, renormalize)


def _one_launch(hidden: torch.Tensor, gate: nn.Module, routing: str) -> bool:
    """Whether the router's product and the rule can run in one launch: one token on CUDA, a 16-bit router weight of
    at most MAX_EXPERTS experts, a rule the kernel knows, and a kernel that compiled here."""
    weight = getattr(gate, "weight", None)
    if not (hidden.is_cuda and _fused.usable and isinstance(weight, torch.Tensor)
            and weight.dtype in (torch.bfloat16, torch.float16) and routing in ("softmax_topk", "topk_softmax")):
        return False
    from radixserve.kernels.moe_routing import FUSED_MAX_TOKENS, MAX_EXPERTS  # CPU-only processes never import triton

    return hidden.numel() == FUSED_MAX_TOKENS * hidden.shape[-1] and weight.shape[0] <= MAX_EXPERTS


def select_experts_torch(router_logits: torch.Tensor, top_k: int, routing: str,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in torch ops on any device (the CPU's form; on CUDA, what the kernel replaces)."""
    if routing == "topk_softmax":
        top_logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), ids
    if routing != "softmax_topk":
        raise ValueError(f"unknown MoE routing {routing!r}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
