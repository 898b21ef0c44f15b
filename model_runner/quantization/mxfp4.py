"""MXFP4 weights (OCP microscaling FP4, as gpt-oss ships its experts), dequantized to a float dtype at load.

A checkpoint stores each quantized tensor `W [..., rows, K]` as two uint8 tensors: `<name>_blocks [..., rows, K/32,
16]`, two FP4 (e2m1) codes a byte, the element of even index in the low nibble, and `<name>_scales [..., rows, K/32]`,
one e8m0 exponent (the scale 2^(s - 127)) for each block of 32 consecutive values of a row.

Every e2m1 value (0, 0.5, ..., 6, and their negatives) is exact in FP8 e4m3, and each block's scale is a power of two:
`mxfp4_as_fp8` rewrites the blocks, exactly, as FP8 values with a float32 scale per block of 32, a layout the fused
MoE kernels read (1.125 bytes a value where a 16-bit copy takes 2); they also read the codes and exponents as stored
(kernels/fused_moe_experts.py, about 0.53 bytes a value). `quantize_mxfp4` makes MXFP4 of 16-bit weights (random
weights under an MXFP4 config, as the GPU benchmarks load).
"""

from __future__ import annotations

import torch

# The sixteen e2m1 codes: sign bit, two exponent bits, one mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_SIZE = 32
_E8M0_BIAS = 127


def _unpack(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values [..., groups, 32] float32, exponents [..., groups] int32)` of checked MXFP4 tensors."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: expected "
                         f"blocks [..., groups, {BLOCK_SIZE // 2}] and scales [..., groups]")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # [..., groups, 16, 2]: low, high
    return table[codes].reshape(*scales.shape, BLOCK_SIZE), scales.to(torch.int32) - _E8M0_BIAS


def mxfp4_as_fp8(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values [..., rows, K] float8_e4m3fn, scale [..., rows, K/32] float32)` from `blocks [..., rows, K/32, 16]`
    and `scales [..., rows, K/32]`: `values * scale` (each block's 32 values times its scale) is exactly the MXFP4
    tensor's value."""
    values, exponents = _unpack(blocks, scales)
    values = values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE).to(torch.float8_e4m3fn)
    return values, torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.to(torch.float32))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(blocks [..., K/32, 16], scales [..., K/32])` uint8 of `weight [..., K]` (K a multiple of 32): per block of 32,
    the smallest power of two that brings its largest magnitude within 6 (e2m1's largest), then each value rounded to
    the nearest code (a tie to the smaller magnitude); the element of even index in the low nibble."""
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"MXFP4 quantizes rows of whole blocks of {BLOCK_SIZE}, got {weight.shape[-1]} values")
    groups = weight.float().contiguous().reshape(*weight.shape[:-1], -1, BLOCK_SIZE)
    largest = groups.abs().amax(-1)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(1 - _E8M0_BIAS, _E8M0_BIAS)
    scaled = groups * torch.exp2(-exponents).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    nearest = torch.bucketize(scaled.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2)
    codes = (nearest | (((scaled < 0) & (nearest > 0)).to(torch.int64) << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + _E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., rows, K]` in `dtype` from `blocks [..., rows, K/32, 16]` and `scales [..., rows, K/32]` (uint8).

    Exact in float32 (a code times a power of two); rounded once to `dtype`. ValueError on mismatched shapes."""
    values, exponents = _unpack(blocks, scales)
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE).to(dtype)
