"""The gated delta rule (Gated DeltaNet's token mixer) and its causal convolution, in torch.

Per value head, the recurrent state `S` is a `[Dk, Dv]` matrix. Token t, with query q_t and key k_t (L2-normalised,
q scaled by `scale`), value v_t, log-decay g_t <= 0 and write strength beta_t in (0, 1), does

    S  <- exp(g_t) * S                          decay
    u_t = beta_t * (v_t - S^T k_t)               the part of v_t the state does not predict yet (delta rule)
    S  <- S + k_t u_t^T                          write
    o_t = S^T q_t                                read

Two forms compute it:

- `recurrent_gated_delta_rule`: the loop above, vectorised over a batch of sequences of equal length; decode runs
  it with one token per request.
- `chunk_gated_delta_rule`: one sequence, `chunk_size` tokens at a time. Inside a chunk with initial state S0 and
  cumulative log-decay c_i = g_1 + ... + g_i, the writes u solve the unit lower-triangular system
      u_i + beta_i * sum_{j<i} exp(c_i - c_j) (k_i . k_j) u_j = beta_i * (v_i - exp(c_i) S0^T k_i),
  and then o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i . k_j) u_j and
  S_end = exp(c_C) S0 + sum_j exp(c_C - c_j) k_j u_j^T: a few matmuls per chunk instead of a step per token.

Both take and return the state (float32, `[..., H, Dk, Dv]`) so a request resumes where its last batch, or the
prefix cache's snapshot, left off. Grouped heads (fewer key heads than value heads) are expanded by the caller.
On CUDA the layer calls flash-linear-attention's kernels instead when they import (`fla_kernels`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6  # as flash-linear-attention's in-kernel L2 norm


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over `T` steps for `B` sequences at once.

    `q`, `k` `[B, T, H, Dk]`, `v` `[B, T, H, Dv]`, `g`, `beta` `[B, T, H]`, `state` `[B, H, Dk, Dv]`. Returns the
    float32 outputs `[B, T, H, Dv]` and the new state (a new tensor; `state` is not written).
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = state.float().clone()
    outputs = []
    for t in range(q.shape[1]):
        state.mul_(g[:, t].exp()[..., None, None])
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        update = (v[:, t] - predicted) * beta[:, t, :, None]
        state.add_(k[:, t, :, :, None] * update[:, :, None, :])
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(outputs, dim=1), state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation for one sequence, a chunk at a time (see the module docstring).

    `q`, `k` `[T, H, Dk]`, `v` `[T, H, Dv]`, `g`, `beta` `[T, H]`, `state` `[H, Dk, Dv]`. Returns the float32
    outputs `[T, H, Dv]` and the final state.
    """
    # Heads first: [H, T, D]; everything in float32.
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    g, beta = (x.float().transpose(0, 1) for x in (g, beta))
    state = state.float()
    num_tokens = q.shape[1]
    outputs = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        qc, kc, vc = q[:, start:end] * scale, k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # [H, C]
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        # exp(c_i - c_j) for j <= i, zero above the diagonal (masked before exp: never exp of a positive number).
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        strict = decay.masked_fill(torch.eye(length, dtype=torch.bool, device=q.device), 0.0)
        system = torch.eye(length, device=q.device) + bc * (kc @ kc.transpose(1, 2)) * strict
        start_decay = cum.exp()[..., None]  # [H, C, 1]
        rhs = bc * (vc - start_decay * (kc @ state))
        writes = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out = start_decay * (qc @ state) + ((qc @ kc.transpose(1, 2)) * decay) @ writes
        outputs.append(out)
        end_decay = (cum[:, -1:] - cum).exp()[..., None]  # [H, C, 1]: exp(c_C - c_j)
        state = cum[:, -1].exp()[:, None, None] * state + (kc * end_decay).transpose(1, 2) @ writes
    if not outputs:
        return v.new_zeros(num_tokens, v.shape[0], v.shape[2]), state.clone()
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one sequence, then SiLU.

    `x` `[T, C]`, `conv_state` `[C, K - 1]` (the inputs before this sequence's first token, zeros at its start),
    `weight` `[C, K]`. Returns the output `[T, C]` and the new state: the last K - 1 inputs.
    """
    width = weight.shape[1]
    padded = torch.cat([conv_state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(padded[None], weight[:, None, :].to(x.dtype), bias, groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1), padded[:, padded.shape[1] - (width - 1):]


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence for `B` sequences: `x` `[B, C]`, `conv_state` `[B, C, K - 1]`. Returns the output
    `[B, C]` and the new state."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


@functools.lru_cache(maxsize=1)
def fla_kernels() -> Optional[Any]:
    """flash-linear-attention's gated-delta-rule Triton kernels (`fla.ops.gated_delta_rule`), or None when the
    package does not import here."""
    try:
        from fla.ops import gated_delta_rule
    except Exception:  # not installed, or its Triton cannot run on this machine
        return None
    return gated_delta_rule
