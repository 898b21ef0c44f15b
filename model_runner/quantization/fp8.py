"""FP8 (e4m3) weights: the value a loader builds for one linear, and the GEMM that multiplies with it.

Weights are `[N, K]` float8_e4m3fn with float32 scales, dequantized value `weight * scale`:

- per output channel: `scale [N]` (a per-tensor checkpoint's scalar is spread over its rows, so q/k/v or gate/up of
  different scales fuse into one matrix; `tensor_scale` keeps the scalar where the whole matrix shares one);
- per block: `scale [ceil(N / bn), ceil(K / bk)]` for `(bn, bk)` blocks (128 x 128 in released checkpoints).

Activations are quantized at each call (`ActivationScheme`): per token (dynamic), per tensor (dynamic, or static
with the checkpoint's `input_scale`), or per token and group of `bk` features for block weights. On CUDA the products
run on FP8 tensor cores: `torch._scaled_mm` (cuBLASLt) per tensor or row-wise, the Triton block-scaled GEMM
(kernels/fp8_block_gemm.py) for blocks; up to `SKINNY_MAX_ROWS` rows (decode) the activations stay unquantized and
the weight is dequantized in registers (kernels/fp8_skinny_gemm.py), the product of the dequantized weight. Elsewhere the reference computes the same quantized operands in float32:
`(x_q * x_scale) @ (w_q * w_scale).T`, the product both GPU paths approximate up to accumulation order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.kernels.guard import KernelGuard

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Scales never go below this, so an all-zero row quantizes to zeros instead of NaNs.
MIN_SCALE = 1e-12
# Rows up to which a CUDA call multiplies the weight dequantized in registers (kernels/fp8_skinny_gemm.py.MAX_ROWS).
SKINNY_MAX_ROWS = 16


class ActivationScheme(enum.Enum):
    TOKEN = "token"  # one dynamic scale per row
    TENSOR = "tensor"  # one dynamic scale per call
    STATIC = "static"  # the checkpoint's per-tensor input_scale
    GROUP = "group"  # one dynamic scale per row and group of block_k features (block weights)


def quantize_per_row(x: torch.Tensor, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` to FP8 with one float32 scale per row (`[M, 1]`), or per row and group of `group` features
    (`[M, ceil(K / group)]`); scale = amax / 448. On CUDA one Triton launch (kernels/fp8_quant.py)."""
    if x.is_cuda:
        from radixserve.kernels.fp8_quant import quantize_fp8

        return quantize_fp8(x, group)
    m, k = x.shape
    if group is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group)[:, :k].to(FP8_DTYPE)
    return q, scale.view(m, groups)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale`, saturated and rounded to FP8 (`scale` broadcast against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A per-block scale `[ceil(rows / bn), ceil(cols / bk)]` repeated to one value per element `[rows, cols]`."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


@dataclass
class Fp8Weight:
    """One linear's FP8 weight (or one part of a fused one, or this rank's shard); see the module docstring."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # float32 [N] per channel, or [ceil(N / bn), ceil(K / bk)] per block
    block: Optional[tuple[int, int]] = None  # (bn, bk) for block scales
    input_scale: Optional[torch.Tensor] = None  # float32 scalar: a static activation scale

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 values `[N, K]`."""
        n, k = self.shape
        scale = self.scale[:, None] if self.block is None else expand_blocks(self.scale, n, k, self.block)
        return self.weight.float() * scale

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """Rows (dim 0: output features) or columns (dim 1: input features) `[start, start + length)`; with block
        scales the cut must fall on a block boundary (or the matrix's end)."""
        weight = self.weight.narrow(dim, start, length)
        if self.block is None:
            scale = self.scale.narrow(0, start, length) if dim == 0 else self.scale
        else:
            size = self.block[dim]
            if start % size or (length % size and start + length != self.weight.shape[dim]):
                raise ValueError(f"an FP8 weight with {self.block[0]}x{self.block[1]} block scales cannot be split at "
                                 f"[{start}, {start + length}) of dimension {dim}: the cut must fall on a block "
                                 "boundary (a tensor-parallel size or head layout that splits a block)")
            scale = self.scale.narrow(dim, start // size, -(-length // size))
        return Fp8Weight(weight, scale, self.block, self.input_scale)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """The parts stacked along the output features (q/k/v, gate/up)."""
        first = parts[0]
        if any(p.block != first.block for p in parts):
            raise ValueError("the parts of a fused projection have different FP8 scale layouts")
        if first.block is not None and any(p.shape[0] % first.block[0] for p in parts[:-1]):
            raise ValueError(f"a fused projection's parts ({[p.shape[0] for p in parts]} rows) do not fill whole "
                             f"{first.block[0]}-row scale blocks")
        input_scales = [p.input_scale for p in parts if p.input_scale is not None]
        # Fused parts read the same input: the largest static scale saturates none of them.
        input_scale = torch.stack(input_scales).amax() if input_scales else None
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), first.block,
                         input_scale)

    @staticmethod
    def quantize(weight: torch.Tensor, block: Optional[tuple[int, int]] = None,
                 per_tensor: bool = False) -> "Fp8Weight":
        """A float weight `[N, K]` to FP8 with one scale per output channel, per `block`, or (`per_tensor`) one for
        the whole matrix (spread over its rows)."""
        if per_tensor:
            scale = (weight.abs().amax().float() / FP8_MAX).clamp_min(MIN_SCALE)
            return Fp8Weight(quantize_with_scale(weight, scale), scale.reshape(1).expand(weight.shape[0]).contiguous())
        if block is None:
            q, scale = quantize_per_row(weight)
            return Fp8Weight(q, scale.view(-1))
        n, k = weight.shape
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
        blocks = padded.view(rows, bn, cols, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
        q = quantize_with_scale(blocks, scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
        return Fp8Weight(q.contiguous(), scale, block)


# kernels/fp8_skinny_gemm.py, turned off (the reason logged) once it fails to compile for this device.
_skinny = KernelGuard("the skinny FP8 kernel", "the FP8 GEMMs serve every row count")


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, activation: ActivationScheme,
               tensor_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """`x [M, K] @ W.T` in x's dtype, x quantized by `activation`; `tensor_scale`: the weight's one scale where all
    its rows share it (a per-tensor product on CUDA), else None. On CUDA, a few rows (decode) multiply the
    unquantized activations with the weight dequantized in registers instead (kernels/fp8_skinny_gemm.py): there
    the weight's bytes are the whole cost."""
    if x.is_cuda and x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and _skinny.usable:
        from radixserve.kernels.fp8_skinny_gemm import w8a16_gemm  # CPU-only processes never import triton

        try:
            return w8a16_gemm(x, weight.weight, weight.scale, weight.block)
        except Exception as exc:  # a Triton build without this device's FP8 conversions: a compile error
            if not _skinny.absorb(exc):
                raise
    if weight.block is not None:
        bk = weight.block[1]
        if activation is ActivationScheme.TOKEN:  # one scale per row is a group scale repeated over the groups
            x_q, row_scale = quantize_per_row(x)
            x_scale = row_scale.expand(-1, -(-x.shape[1] // bk)).contiguous()
        else:
            x_q, x_scale = quantize_per_row(x, bk)
        if x.is_cuda:
            from radixserve.kernels.fp8_block_gemm import fp8_block_gemm

            return fp8_block_gemm(x_q, x_scale, weight.weight, weight.scale, weight.block, x.dtype)
        x_values = x_q.float() * x_scale.repeat_interleave(bk, dim=1)[:, : x.shape[1]]
        return (x_values @ weight.dequantize().T).to(x.dtype)

    if activation is ActivationScheme.TOKEN:
        x_q, x_scale = quantize_per_row(x)
    else:
        if activation is ActivationScheme.STATIC:
            x_scale = weight.input_scale.float().reshape(())
        else:
            x_scale = (x.abs().amax().float() / FP8_MAX).clamp_min(MIN_SCALE)
        x_q = quantize_with_scale(x, x_scale)
    if x.is_cuda:
        if x_scale.dim() == 0 and tensor_scale is not None:
            return torch._scaled_mm(x_q, weight.weight.T, scale_a=x_scale, scale_b=tensor_scale, out_dtype=x.dtype)
        scale_a = x_scale.reshape(-1, 1).expand(x.shape[0], 1).contiguous()
        return torch._scaled_mm(x_q, weight.weight.T, scale_a=scale_a, scale_b=weight.scale.view(1, -1),
                                out_dtype=x.dtype)
    x_values = x_q.float() * (x_scale if x_scale.dim() == 0 else x_scale.view(-1, 1))
    return (x_values @ weight.dequantize().T).to(x.dtype)
