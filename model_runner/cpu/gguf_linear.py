"""Linear layers that compute on a GGUF file's own blocks (`--quantization gguf`, CPU): the weights stay in llama.cpp's
blocks, and kernels/cpu_gguf_linear.cpp multiplies on them.

- Q8_0 / Q4_0 / Q4_1 on CPUs with AVX-512 BW and VNNI, rows a multiple of 16: the blocks are re-laid 16 rows at a
  time at load (`gguf_interleave`, kernels/cpu_gguf_x16.h), so that one 512-bit integer multiply-add serves 16 rows;
  the activations are rounded per block of 32 to 16-bit integers (1/65534 of the block's largest value) and meet the
  blocks' integers exactly. On the embedded model's shapes this outpaces both the in-register kernel below (about
  2x at one row) and the float32 GEMM (1.3x at 16 rows, 1.7x at 512: benchmarks/gguf_default.py), so it serves every
  row count, prefill included, and no float weight is kept beside it. Against the float32 path it keeps the greedy
  ids of 15 of 16 prompts (the 16th parts at a near tie; benchmarks/cpu_gguf_int8_agreement.py).
- Q8_0 / Q4_0 / Q4_1 elsewhere: the blocks are dequantized in registers into float32 multiply-adds with the float32
  activations: the result is the float32 product of the dequantized weight, as Hugging Face computes it on the
  converted checkpoint. At a few decode rows a linear layer costs reading its weight, and a Q4_1 weight is 5/8 of a
  byte per value (float32: 4). From `DEQUANTIZE_FROM` rows on (prefill) the arithmetic dominates instead: the weight
  is dequantized whole, once per call, and multiplied by oneDNN's float32 GEMM.
- Q4_K / Q5_K / Q6_K (super-blocks of 256): integer dot products against the activations quantized per block of 256,
  as llama.cpp multiplies them (kernels/cpu_gguf_kquants.h), at every row count, so prefill and decode round alike.
  The activations are 14-bit integers (`KQUANT_ACTIVATION_BITS`), not llama.cpp's int8: int8 rounding changes greedy
  tokens against the float product of the dequantized weights (0 of 16 prompts kept Hugging Face's 32 tokens on a
  tiny random llama), 14 bits keep them.
- `--gguf-activations int8`: llama.cpp's arithmetic, the activations rounded to int8 per block (32 values for Q8_0 /
  Q4_0 / Q4_1: the interleaved blocks' int8 layout, `vpdpbusd`, else kernels/cpu_gguf_q8.h; 256 for the K-quants)
  and multiplied in integers. Faster, but a different function: on the embedded SmolLM2 it keeps the float32 path's
  greedy tokens on 5 of 16 prompts over 32 tokens (bfloat16: 7; docs/quantization.md). Interleaved blocks take int8
  activations at every row count, prefill included, where `vpdpbusd`'s four products a lane run 1.5-1.7x the 16-bit
  kernel; blocks that are not interleaved take them at decode rows, their prefill rows on the dequantized float32
  GEMM; the K-quants, whose kernel runs at every row count, at every row count.
The model is loaded from the converted directory as for the float path, then `use_gguf_blocks` swaps each fused
projection (qkv, gate/up, o, down) whose parts are stored in one block type for a `GGUFLinear` on the concatenated
blocks, and the LM head (the embedding's matrix where tied) for one on its own. Asked for (`--quantization gguf`),
their float weights are dropped. Chosen by default (model_runner/cpu/gguf_default.py), projections whose blocks are not
interleaved keep their float linears for prefill rows, so that a prompt costs what it costs on the float path while
decode reads the blocks. The embedding lookup, norms, attention and sampling are unchanged, in float32.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_build
from radixserve.model_runner.loader.gguf_blocks import BlockMatrix, read_block_matrices
from radixserve.model_runner.parallel import RowParallelLinear

logger = logging.getLogger(__name__)

# Rows from which a call dequantizes the whole weight and runs `F.linear` (measured with benchmarks/cpu_gguf_linear.py
# on the embedded model's shapes: the in-register kernel is ahead below 16-32 rows).
DEQUANTIZE_FROM = 32
# Rows from which a projection that kept its float linear (blocks chosen by default) runs it instead of the blocks:
# from a few rows the float kernels' arithmetic outpaces the blocks' in-register dequantization, while below it the
# blocks' smaller reads win (benchmarks/gguf_default.py --rows measures the crossover).
DENSE_FROM = 8
# The block types whose kernel takes the float32 activations (the K-quants round them to integers instead).
FLOAT_ACTIVATION_TYPES = frozenset({2, 3, 8})
# Blocks of those types are re-laid 16 rows at a time (kernels/cpu_gguf_x16.h) where the kernel runs in vector
# registers (AVX-512 BW + VNNI) and the rows are a multiple of `INTERLEAVED_ROWS`; the kernel's type id is the GGML
# type's + `INTERLEAVED[activations]` (16-bit integer activations for `float32`, int8 for `int8`).
INTERLEAVED, INTERLEAVED_ROWS = {"float32": 256, "int8": 512}, 16
# The K-quants' activations: 16 (14-bit integers in 16-bit multiply-adds) or 8 (llama.cpp's int8, VNNI's dot products).
KQUANT_ACTIVATION_BITS = 16
# `--gguf-activations` -> the kernel's activation_bits for (the Q8_0 / Q4_0 / Q4_1 blocks, the K-quants)
ACTIVATION_BITS = {"float32": (16, KQUANT_ACTIVATION_BITS), "int8": (8, 8)}

# fused projection -> the Hugging Face projections stacked in it, in row order
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def interleaves(matrix: BlockMatrix) -> bool:
    """Whether `GGUFLinear` re-lays `matrix` 16 rows at a time (see `INTERLEAVED`)."""
    return (matrix.ggml_type in FLOAT_ACTIVATION_TYPES and matrix.out_features % INTERLEAVED_ROWS == 0
            and torch.ops.radixserve_cpu.gguf_interleaved_vectorized())


class GGUFLinear(nn.Module):
    """`x @ W.T (+ bias)` with W in llama.cpp's blocks: `x [..., in_features]` float32 on the CPU -> float32. With
    `dense` (the float linear of the same weight, kept), rows from `DENSE_FROM` on run through it. Blocks that
    `interleaves` re-lays run every row count on their kernel (`every_row`: with float32 activations it outpaces the
    float32 GEMM at any, with int8 ones it is llama.cpp's arithmetic at any; a `dense` given with them is not
    kept)."""

    def __init__(self, matrix: BlockMatrix, bias: Optional[torch.Tensor] = None, activations: str = "float32",
                 dense: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = matrix.in_features, matrix.out_features
        self.ggml_type = matrix.ggml_type
        self.activations = activations
        float_bits, kquant_bits = ACTIVATION_BITS[activations]
        self.activation_bits = float_bits if matrix.ggml_type in FLOAT_ACTIVATION_TYPES else kquant_bits
        self.interleaved = interleaves(matrix)
        blocks = matrix.blocks
        if self.interleaved:
            blocks = torch.ops.radixserve_cpu.gguf_interleave(blocks, matrix.ggml_type, self.activation_bits)
            dense = None
        # the kernel's type id: the GGML type's, + INTERLEAVED[activations] for re-laid blocks
        self.kernel_type = matrix.ggml_type + INTERLEAVED[activations] if self.interleaved else matrix.ggml_type
        # whether the kernel serves every row count: interleaved blocks (16-bit or int8 activations alike)
        self.every_row = self.interleaved
        self.register_buffer("blocks", blocks, persistent=False)
        self.bias = bias
        self.dense = dense  # a child module, so that the runner's CPU packing (small_batch.py) reaches it
        # A head whose float linear the CPU packing gives it (small_batch.py): the tied embedding's matrix, packed as
        # the float path packs its head, for `DENSE_FROM` rows and more.
        self.wants_dense = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() >= DENSE_FROM * self.in_features:
            return self.dense(x)
        if (not self.every_row and self.ggml_type in FLOAT_ACTIVATION_TYPES
                and x.numel() >= DEQUANTIZE_FROM * self.in_features):
            return F.linear(x, torch.ops.radixserve_cpu.gguf_dequantize(self.blocks, self.kernel_type), self.bias)
        return torch.ops.radixserve_cpu.gguf_linear(x, self.blocks, self.kernel_type, self.bias, self.activation_bits)

    def extra_repr(self) -> str:
        name = BlockMatrix(self.ggml_type, self.blocks, self.in_features).type_name
        return (f"in_features={self.in_features}, out_features={self.out_features}, {name}"
                f"{' interleaved' if self.interleaved else ''}, {self.activations} activations")


def _stacked(parts: list[BlockMatrix]) -> Optional[BlockMatrix]:
    """The parts of one fused projection as one matrix, or None when they are not all of one block type."""
    if len({p.ggml_type for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
        return None
    blocks = parts[0].blocks if len(parts) == 1 else torch.cat([p.blocks for p in parts])
    return BlockMatrix(parts[0].ggml_type, blocks.contiguous(), parts[0].in_features)


def use_gguf_blocks(model: nn.Module, gguf_path: str, activations: str = "float32", keep_float: bool = False) -> int:
    """Swap `model`'s projections and LM head for `GGUFLinear`s on `gguf_path`'s blocks (those stored in a block
    type; the others keep their float weights), multiplying `activations` (float32 or int8). With
    `keep_float`, each swapped projection keeps its float linear for prefill rows, and the head is given the float
    path's head for as many rows (more memory: the float weights stay beside the blocks). Loads the CPU kernels
    first (a RuntimeError where they cannot be built). Returns how many linears now read blocks."""
    if activations not in ACTIVATION_BITS:
        raise ValueError(f"GGUF activations are {' or '.join(ACTIVATION_BITS)}, got {activations!r}")
    if not cpu_build.load():
        raise RuntimeError("--quantization gguf needs radixserve's C++ CPU kernels, which could not be built here "
                           "(see the log); use --dtype float32 or bfloat16")
    matrices = read_block_matrices(gguf_path)
    swapped = 0
    for index, layer in enumerate(model.model.layers):
        for fused, parts in _FUSED_PARTS.items():
            names = [f"model.layers.{index}.{part}.weight" for part in parts]
            if not all(name in matrices for name in names):
                continue
            matrix = _stacked([matrices[name] for name in names])
            owner_name, _, attr = fused.rpartition(".")
            owner = getattr(layer, owner_name)
            current = getattr(owner, attr)
            if matrix is None or type(current) not in (nn.Linear, RowParallelLinear):
                continue
            if tuple(current.weight.shape) != (matrix.out_features, matrix.in_features):
                raise ValueError(f"layer {index} {fused}: the GGUF blocks hold {matrix.out_features}x"
                                 f"{matrix.in_features} values, the model {tuple(current.weight.shape)}")
            bias = None if current.bias is None else current.bias.detach().float()
            setattr(owner, attr, GGUFLinear(matrix, bias, activations, dense=current if keep_float else None))
            swapped += 1
    head_name = "lm_head.weight" if "lm_head.weight" in matrices else "model.embed_tokens.weight"
    if head_name in matrices and model.config.tie_word_embeddings == (head_name != "lm_head.weight"):
        model.logits_head = GGUFLinear(matrices[head_name], activations=activations)
        model.logits_head.wants_dense = keep_float and not model.logits_head.every_row
        swapped += 1
    logger.info("GGUF blocks: %d linears compute on %s's blocks (%s), %s activations", swapped, gguf_path,
                ", ".join(sorted({m.type_name for m in matrices.values()})), activations)
    return swapped
