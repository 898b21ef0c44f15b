"""4-bit grouped weights with 16-bit activations (W4A16): one layout for AWQ, GPTQ and compressed-tensors'
pack-quantized, and the GEMM that multiplies with it.

The layout (`Int4Weight`) is the one the Triton kernel reads (kernels/w4a16_gemm.py): unsigned 4-bit values packed
eight along the input features, `qweight [K / 8, N]` int32, and per group of input features a scale and a zero point
in the unsigned domain, `scales`, `zeros` `[groups, N]`: `W[n, k] = (q[n, k] - zeros[g(k), n]) * scales[g(k), n]`,
`g(k) = k // group_size`, or `g_idx[k]` for GPTQ's act-order checkpoints. Each format's loader (formats.py) turns its
own packing into this one when the weights load, so the kernel and the fusion of q/k/v and gate/up know one layout.

On CUDA the product runs in the Triton kernel; elsewhere the reference dequantizes the weight into the activations'
dtype and multiplies with `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

PACK_FACTOR = 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a word sits at bits 4j


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values `[R, C]` (any integer dtype, R a multiple of 8) to int32 `[R / 8, C]`, row `8i + j`
    in bits `4j` of word row `i`."""
    rows, cols = values.shape
    grouped = values.to(torch.int32).view(rows // PACK_FACTOR, PACK_FACTOR, cols)
    return (grouped << _SHIFTS.to(values.device).view(1, -1, 1)).sum(dim=1, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_rows`: int32 `[R / 8, C]` to unsigned values `[R, C]` (uint8)."""
    words, cols = packed.shape
    nibbles = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device).view(1, -1, 1)) & 0xF
    return nibbles.reshape(words * PACK_FACTOR, cols).to(torch.uint8)


@dataclass
class Int4Weight:
    """One linear's 4-bit weight (or a part of a fused one, or this rank's shard); see the module docstring."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # [groups, N], the activations' dtype
    zeros: torch.Tensor  # [groups, N], same dtype: zero points in the unsigned domain (8 for symmetric weights)
    group_size: int
    g_idx: Optional[torch.Tensor] = None  # int32 [K]: each input feature's group where groups are not runs of K

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[1], self.qweight.shape[0] * PACK_FACTOR

    def groups_of_columns(self) -> torch.Tensor:
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values `[N, K]` in `dtype` (the arithmetic in float32)."""
        groups = self.groups_of_columns()
        q = unpack_rows(self.qweight).float()  # [K, N]
        w = (q - self.zeros.float()[groups]) * self.scales.float()[groups]
        return w.T.to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> "Int4Weight":
        """Rows (dim 0: output features) or columns (dim 1: input features) `[start, start + length)`. Input
        features are cut at whole words, and, without `g_idx`, at whole groups."""
        if dim == 0:
            return Int4Weight(self.qweight.narrow(1, start, length), self.scales.narrow(1, start, length),
                              self.zeros.narrow(1, start, length), self.group_size, self.g_idx)
        if start % PACK_FACTOR or length % PACK_FACTOR:
            raise ValueError(f"a 4-bit weight cannot be split at input features [{start}, {start + length}): the cut "
                             "must fall on a multiple of 8")
        qweight = self.qweight.narrow(0, start // PACK_FACTOR, length // PACK_FACTOR)
        if self.g_idx is not None:  # the groups stay whole; this shard's columns keep their group numbers
            return Int4Weight(qweight, self.scales, self.zeros, self.group_size, self.g_idx.narrow(0, start, length))
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"a 4-bit weight in groups of {self.group_size} cannot be split at input features "
                             f"[{start}, {start + length}): the cut must fall on a group boundary")
        first, count = start // self.group_size, length // self.group_size
        return Int4Weight(qweight, self.scales.narrow(0, first, count), self.zeros.narrow(0, first, count),
                          self.group_size)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """The parts stacked along the output features (q/k/v, gate/up). They read the same input, so they share
        its grouping: GPTQ orders a layer's columns by its input's statistics, which q/k/v (and gate/up) share."""
        first = parts[0]
        for part in parts[1:]:
            same_groups = (part.g_idx is None and first.g_idx is None) or (
                part.g_idx is not None and first.g_idx is not None and torch.equal(part.g_idx, first.g_idx))
            if part.group_size != first.group_size or not same_groups:
                raise ValueError("the parts of a fused projection group their input features differently (group size "
                                 "or act-order g_idx), so they cannot share one 4-bit matrix")
        return Int4Weight(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                          torch.cat([p.zeros for p in parts], dim=1), first.group_size, first.g_idx)

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> "Int4Weight":
        """A float weight `[N, K]` rounded to the nearest of 16 levels per group (asymmetric: min to max), for weights
        drawn at random (`--load-format dummy`)."""
        n, k = weight.shape
        groups = weight.float().view(n, k // group_size, group_size)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(1e-8)
        zero = (-low / scale).round().clamp(0, 15)
        q = (groups / scale + zero).round().clamp(0, 15).view(n, k)
        return Int4Weight(pack_rows(q.T.contiguous()), scale.view(n, -1).T.to(dtype).contiguous(),
                          zero.view(n, -1).T.to(dtype).contiguous(), group_size)

    def finalized(self) -> "Int4Weight":
        """The same weight with contiguous tensors and `g_idx` dropped where it is the plain `k // group_size`."""
        g_idx = self.g_idx
        if g_idx is not None:
            plain = torch.arange(g_idx.numel(), device=g_idx.device) // self.group_size
            g_idx = None if torch.equal(g_idx.long(), plain) else g_idx.to(torch.int32).contiguous()
        return Int4Weight(self.qweight.contiguous(), self.scales.contiguous(), self.zeros.contiguous(),
                          self.group_size, g_idx)


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`x [M, K] @ W.T` in x's dtype."""
    if x.is_cuda:
        from radixserve.kernels.w4a16_gemm import w4a16_gemm

        return w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.g_idx)
    return F.linear(x, weight.dequantize(x.dtype))
