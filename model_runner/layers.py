"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP activation.

Each block reproduces the arithmetic of the Hugging Face reference implementation operation for operation
(same casts, same order), so a float32 model here yields the same greedy tokens as `transformers`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with an optional fused residual add.

    `forward(x)` returns `norm(x)`. `forward(x, residual)` first forms `s = x + residual` and returns
    `(norm(s), s)`: the decoder layers keep the running residual stream in `s`, so the add that precedes
    every norm happens in one place. The statistics are computed in float32 whatever the input dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = residual + x
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused `[..., 2 * intermediate]` projection laid out as `[gate | up]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- rotary position embedding -------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: Optional[dict]) -> str:
    """The RoPE variant named by a config's `rope_scaling` (old key `type` or new key `rope_type`)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"


def rope_inverse_frequencies(rotary_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    """Float32 inverse frequencies `[rotary_dim // 2]`, after the scaling a config asks for.

    Supports the default RoPE, "linear" (position interpolation) and "llama3" (Llama 3.1's frequency-band
    rescaling). Variants whose frequencies depend on the current sequence length ("dynamic") or that also
    scale attention ("yarn", "longrope") are refused rather than silently computed wrong. Computed on the
    CPU whatever the default device (models are built under the meta device).
    """
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band between
    # the two thresholds interpolated smoothly.
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    original_context = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style rotary embedding (the two halves of each head rotate together), as in HF Llama/Qwen.

    Holds a float32 cos/sin table for positions `[0, max_positions)`. It is a plain object rather than a
    module so that building a model on the meta device and materialising it never touches the table; the
    table moves to the device of the positions on first use.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        rope_scaling: Optional[dict] = None,
    ) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = rope_inverse_frequencies(head_dim, base, rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `q [T, Hq, D]` and `k [T, Hk, D]` by the angles of `positions [T]`."""
        if self.cos.device != positions.device:
            self.cos = self.cos.to(positions.device)
            self.sin = self.sin.to(positions.device)
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equals `x * [cos, cos] + rotate_half(x) * [sin, sin]` bit for bit (a + (-b) == a - b in IEEE).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
