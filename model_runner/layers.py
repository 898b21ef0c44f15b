"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP activation.

Each block reproduces the arithmetic of the Hugging Face reference implementation operation for operation
(same casts, same order), so a float32 model here yields the same greedy tokens as `transformers`.

Three implementations sit behind the blocks, chosen in one place (`ops_for`) by the device of the input:
`TORCH_OPS`, plain torch and the reference (bit-exact with `transformers` on the CPU); on CUDA the fused
Triton kernels of `radixserve.kernels` (one launch per block instead of up to eighteen); on the CPU, once the
C++ kernels are loaded (`kernels/cpu_build.py`), their one-pass versions (`kernels/cpu_elementwise.cpp`). The
fused ones round as the reference does, so they differ from it only by float32 reduction order and exp.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# ---- the two implementations of the elementwise blocks ---------------------------------------------

def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def _torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return _torch_rms_norm(summed, weight, eps), summed


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _torch_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
    sin = sin_table[positions].to(q.dtype).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _torch_head_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _torch_rotary(positions, _torch_rms_norm(q, q_weight, eps), _torch_rms_norm(k, k_weight, eps), cos_table,
                         sin_table)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equals `x * [cos, cos] + rotate_half(x) * [sin, sin]` bit for bit (a + (-b) == a - b in IEEE).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Ops(NamedTuple):
    """One implementation of the blocks. Contracts (both implementations, all return new tensors):

    - `rms_norm(x, weight, eps)`: `weight * norm(x)` over the last dim, statistics in float32, the normed
      value rounded to x's dtype before the weight product.
    - `add_rms_norm(x, residual, weight, eps)`: `(rms_norm(s), s)` with `s = residual + x`.
    - `silu_and_mul(gate_up)`: `silu(gate) * up` for `gate_up = [..., 2 * I]` laid out `[gate | up]`.
    - `rotary(positions, q, k, cos_table, sin_table)`: neox rotation of `q [T, Hq, D]`, `k [T, Hk, D]` by
      float32 tables `[max_positions, D/2]` indexed by `positions [T]`; returns `(q_rot, k_rot)`.
    - `head_norm_rotary(positions, q, k, cos_table, sin_table, q_weight, k_weight, eps)`: `rotary` of
      `rms_norm(q, q_weight, eps)` and `rms_norm(k, k_weight, eps)` over each head (Qwen3's q and k norms), weights
      `[D]` of q's dtype.
    """

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    head_norm_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]


TORCH_OPS = Ops(_torch_rms_norm, _torch_add_rms_norm, _torch_silu_and_mul, _torch_rotary, _torch_head_norm_rotary)


@functools.cache
def fused_ops() -> Ops:
    """The Triton implementation (imported on first use, so CPU-only processes never import triton)."""
    from radixserve.kernels import fused_activation, fused_norm, fused_rotary

    def head_norm_rotary(positions, q, k, cos, sin, q_weight, k_weight, eps):
        return fused_rotary.apply_rotary(positions, q, k, cos, sin, norms=(q_weight, k_weight, eps))

    return Ops(fused_norm.rms_norm, fused_norm.fused_add_rms_norm, fused_activation.silu_and_mul,
               fused_rotary.apply_rotary, head_norm_rotary)


@functools.cache
def cpu_kernel_ops() -> Ops:
    """The C++ implementation (`torch.ops.radixserve_cpu`, loaded by `kernels/cpu_build.py`)."""
    ops = torch.ops.radixserve_cpu

    def head_norm_rotary(positions, q, k, cos, sin, q_weight, k_weight, eps):
        return tuple(ops.rotary(positions, ops.rms_norm(q, q_weight, eps), ops.rms_norm(k, k_weight, eps), cos, sin))

    return Ops(ops.rms_norm, lambda x, residual, weight, eps: tuple(ops.add_rms_norm(x, residual, weight, eps)),
               ops.silu_and_mul, lambda positions, q, k, cos, sin: tuple(ops.rotary(positions, q, k, cos, sin)),
               head_norm_rotary)


def ops_for(x: torch.Tensor) -> Ops:
    """The implementation for tensors on x's device: fused kernels on CUDA, the C++ kernels on the CPU once
    loaded (float32 and bfloat16), the torch reference otherwise."""
    if x.is_cuda:
        return fused_ops()
    if x.dtype in CPU_KERNEL_DTYPES and x.device.type == "cpu" and cpu_build.ready():
        return cpu_kernel_ops()
    return TORCH_OPS


# ---- blocks ----------------------------------------------------------------------------------------

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

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = ops_for(x)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused `[..., 2 * intermediate]` projection laid out as `[gate | up]`."""
    return ops_for(gate_up).silu_and_mul(gate_up)


# ---- rotary position embedding -------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional", "yarn")


def rope_type_of(rope_scaling: Optional[dict]) -> str:
    """The RoPE variant named by a config's `rope_scaling` (old key `type` or new key `rope_type`)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"


def rope_inverse_frequencies(rotary_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    """Float32 inverse frequencies `[rotary_dim // 2]`, after the scaling a config asks for.

    Supports the default RoPE, "linear" (position interpolation), "llama3" (Llama 3.1's frequency-band
    rescaling), "proportional" (Gemma 4's full layers: the first `partial_rotary_factor` of the frequencies as
    the default's, the rest zero, so those dimensions do not rotate; divided by `factor`) and "yarn" (gpt-oss: see
    `_yarn_scaled`; its cos/sin are also scaled, `rope_attention_factor`). Variants whose frequencies depend on the
    current sequence length ("dynamic") or "longrope" are refused rather than silently computed wrong. Computed on the
    CPU whatever the default device (models are built under the meta device).
    """
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "proportional":
        rotated = int(float(rope_scaling.get("partial_rotary_factor", 1.0)) * rotary_dim // 2)
        inv_freq[rotated:] = 0.0
        inv_freq = inv_freq / float(rope_scaling.get("factor", 1.0))
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_scaled(inv_freq, rotary_dim, base, rope_scaling)
    return inv_freq


def rope_attention_factor(rope_scaling: Optional[dict]) -> float:
    """The factor YaRN multiplies cos and sin by (so every attention score by its square): `attention_factor` when the
    config gives it, else `0.1 * ln(factor) + 1` (or the ratio of two such terms with DeepSeek's `mscale` /
    `mscale_all_dim`); 1 for every other RoPE variant."""
    if rope_type_of(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if rope_scaling.get("mscale") and rope_scaling.get("mscale_all_dim"):
        return mscale(float(rope_scaling["mscale"])) / mscale(float(rope_scaling["mscale_all_dim"]))
    return mscale()


def _yarn_scaled(inv_freq: torch.Tensor, rotary_dim: int, base: float, rope_scaling: dict) -> torch.Tensor:
    # YaRN (arXiv 2309.00071): dimensions that turn more than `beta_fast` times over the original context keep their
    # frequency (extrapolation), those turning fewer than `beta_slow` times are divided by `factor` (interpolation),
    # with a linear ramp between the two; `truncate` rounds the ramp's ends outward to whole dimensions.
    factor = float(rope_scaling["factor"])
    original_context = float(rope_scaling["original_max_position_embeddings"])
    beta_fast = float(rope_scaling.get("beta_fast") or 32)
    beta_slow = float(rope_scaling.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:
        return rotary_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    # The interpolated frequencies as 1 / (factor * base^(2i/d)), rounded as transformers rounds them.
    interpolated = 1.0 / (factor * (1.0 / inv_freq))
    return interpolated * (1 - extrapolated) + inv_freq * extrapolated


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
        attention_factor = rope_attention_factor(rope_scaling)
        self.cos = freqs.cos() * attention_factor
        self.sin = freqs.sin() * attention_factor

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `q [T, Hq, D]` and `k [T, Hk, D]` by the angles of `positions [T]`."""
        self._tables_to(positions.device)
        return ops_for(q).rotary(positions, q, k, self.cos, self.sin)

    def with_head_norms(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm,
                        k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(positions, q_norm(q), k_norm(k))`, the norms over each head (one launch on CUDA)."""
        if q_norm.eps != k_norm.eps or not q_norm.weight.dtype == k_norm.weight.dtype == q.dtype:
            return self(positions, q_norm(q), k_norm(k))
        self._tables_to(positions.device)
        return ops_for(q).head_norm_rotary(positions, q, k, self.cos, self.sin, q_norm.weight, k_norm.weight,
                                           q_norm.eps)

    def _tables_to(self, device: torch.device) -> None:
        if self.cos.device != device:
            self.cos = self.cos.to(device)
            self.sin = self.sin.to(device)
