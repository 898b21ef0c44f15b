"""Gated DeltaNet: the linear-attention layer of hybrid models (Qwen3.5, Qwen3-Next), over the runtime's state pool.

One layer, for the concatenated new tokens of a batch:

    [qkv | z | b | a] = in_proj(x)                       one matmul for HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    qkv  = silu(causal_conv1d(qkv))                      depthwise, kernel K, over each request's past K - 1 inputs
    q, k = l2norm(q), l2norm(k); beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
    o    = gated_delta_rule(q, k, v, g, beta)            per request, from its recurrent state
    out  = out_proj(rmsnorm(o) * silu(z))                the norm per value head, gated by z

The request's conv and recurrent states come from the slots `batch.state_slots` names (radix_cache/state_pool.py):
fresh zeros at position 0, a snapshot when it resumes from a cached prefix, else its working slot; they go back to
its working slot, and to a snapshot slot when the batch asks for one. The math is in model_runner/gated_delta.py; on
CUDA flash-linear-attention's kernels run it where they import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode, StateSlots
from radixserve.model_runner.gated_delta import (causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                                 fla_kernels, l2_normalize, recurrent_gated_delta_rule)

if TYPE_CHECKING:
    from radixserve.model_runner.layer_configs import LinearAttentionConfig
    from radixserve.radix_cache.state_pool import StatePool


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm(x) * silu(gate)` over the last dimension (a value head), statistics in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `state_index` is its place among the model's linear layers (the pool's layer)."""

    def __init__(self, hidden_size: int, shape: "LinearAttentionConfig", state_index: int, eps: float) -> None:
        super().__init__()
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = shape.num_key_heads, shape.num_value_heads
        self.k_dim, self.v_dim = shape.key_head_dim, shape.value_head_dim
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = shape.conv_dim
        self.in_proj = nn.Linear(hidden_size, self.conv_dim + self.value_size + 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, shape.conv_kernel_size))  # HF's conv1d [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden_size, bias=False)
        self.scale = self.k_dim ** -0.5

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: "StatePool") -> torch.Tensor:
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        slots = batch.state_slots or StateSlots.of_rows(batch.req_pool_indices.tolist(), batch.prefix_lens_cpu)
        device = hidden.device
        read = torch.tensor(slots.read, dtype=torch.int64)
        fresh = (read < 0).to(device)
        conv_state, state = pool.read(self.state_index, read.clamp(min=0).to(device), fresh)
        if batch.mode == ForwardMode.DECODE:
            mixed, conv_state = causal_conv1d_step(mixed, conv_state, self.conv_weight)
            q, k, v = self._heads(mixed)
            out, state = self._recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
            out = out[:, 0]
        else:
            out, conv_state, state = self._extend(mixed, g, beta, conv_state, state, batch, slots, pool)
        write = torch.tensor(slots.write, dtype=torch.int64, device=device)
        pool.write(self.state_index, write, conv_state, state)
        snapshot = torch.tensor(slots.snapshot, dtype=torch.int64)
        keep = snapshot >= 0
        if bool(keep.any()):
            rows = keep.nonzero()[:, 0].to(device)
            pool.write(self.state_index, snapshot[keep].to(device), conv_state[rows], state[rows])
        out = self.norm(out.to(hidden.dtype), z.reshape(num_tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k `[T, Hv, Dk]` (L2-normalised, each key head repeated for its value heads), v `[T, Hv, Dv]`."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.reshape(-1, self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=1)
        k = l2_normalize(k.reshape(-1, self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=1)
        return q, k, v.reshape(-1, self.num_v_heads, self.v_dim).float()

    def _recurrent(self, q, k, v, g, beta, state):
        fla = fla_kernels() if q.is_cuda else None
        if fla is None:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state, self.scale)
        out, state = fla.fused_recurrent_gated_delta_rule(
            q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=self.scale,
            initial_state=state.float().contiguous(), output_final_state=True)
        return out, state

    def _extend(self, mixed, g, beta, conv_state, state, batch: ForwardBatch, slots: StateSlots, pool: "StatePool"):
        """Each request's new tokens from its states: the conv per request, then the chunked rule (fla's varlen
        kernel over the whole batch on CUDA). A request whose state before its last token is wanted
        (`slots.before_last`) runs its tokens in two parts and leaves that state in the slot named."""
        convolved, conv_states = [], []
        conv_before_last = {}
        width = self.conv_weight.shape[1]
        start = 0
        for i, length in enumerate(batch.extend_lens_cpu):
            tokens = mixed[start:start + length]
            out, new_conv = causal_conv1d(tokens, conv_state[i], self.conv_weight)
            if slots.before_last[i] >= 0:
                history = torch.cat([conv_state[i].to(tokens.dtype), tokens.transpose(0, 1)], dim=1)
                conv_before_last[i] = history[:, length - 1:length - 1 + width - 1]
            convolved.append(out)
            conv_states.append(new_conv)
            start += length
        q, k, v = self._heads(torch.cat(convolved))
        fla = fla_kernels() if q.is_cuda else None
        if fla is not None and not conv_before_last:
            lens = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
            cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(q.device)
            out, states = fla.chunk_gated_delta_rule(
                q[None], k[None], v[None], g=g[None], beta=beta[None], scale=self.scale,
                initial_state=state.float().contiguous(), output_final_state=True, cu_seqlens=cu_seqlens)
            return out[0], torch.stack(conv_states), states
        outs, states = [], []
        start = 0
        for i, length in enumerate(batch.extend_lens_cpu):
            end = start + length
            split = end - 1 if i in conv_before_last else end
            out, final = self._chunk(q[start:split], k[start:split], v[start:split], g[start:split],
                                     beta[start:split], state[i])
            outs.append(out)
            if split < end:
                slot = torch.tensor([slots.before_last[i]], device=q.device)
                pool.write(self.state_index, slot, conv_before_last[i][None], final[None])
                last, final = self._recurrent(q[None, split:end], k[None, split:end], v[None, split:end],
                                              g[None, split:end], beta[None, split:end], final[None])
                outs.append(last[0])
                final = final[0]
            states.append(final)
            start = end
        return torch.cat(outs), torch.stack(conv_states), torch.stack(states)

    def _chunk(self, q, k, v, g, beta, state):
        """One sequence in the chunked form (fla's kernel on CUDA where it imports)."""
        fla = fla_kernels() if q.is_cuda else None
        if fla is None:
            return chunk_gated_delta_rule(q, k, v, g, beta, state, self.scale)
        out, final = fla.chunk_gated_delta_rule(
            q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g=g[None].contiguous(),
            beta=beta[None].contiguous(), scale=self.scale, initial_state=state[None].float().contiguous(),
            output_final_state=True)
        return out[0], final[0]
