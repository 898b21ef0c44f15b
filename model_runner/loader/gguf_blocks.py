"""A GGUF file's quantized matrices as llama.cpp stores them, for the linear layers that compute on the blocks
(model_runner/cpu/gguf_linear.py).

The converted Hugging Face directory (gguf_convert.py) holds every tensor dequantized; the model is loaded from it
as usual, and then the projections whose GGUF tensor is in one of `BLOCK_TYPES` are swapped for layers that read the
file's own bytes. A matrix comes back as `[rows, row bytes]` uint8, one weight row (K / 32 blocks, or K / 256
super-blocks for the K-quants) per row, under its Hugging Face name; the rows of llama-architecture Q and K projections are put back in Hugging Face's order, as the
converter does for the float values (a row is whole blocks, so permuting rows permutes blocks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from radixserve.model_runner.loader.file_checks import check_gguf
from radixserve.model_runner.loader.gguf_convert import hf_tensor_name, unpermute_rotary_rows

# GGML type id -> (name, values per block, bytes per block): the block formats kernels/cpu_gguf_linear.cpp computes on.
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}


@dataclass(frozen=True)
class BlockMatrix:
    """One weight matrix in llama.cpp's blocks: `blocks [out_features, in_features / block values * block bytes]`
    uint8."""

    ggml_type: int
    blocks: torch.Tensor
    in_features: int

    @property
    def type_name(self) -> str:
        return BLOCK_TYPES[self.ggml_type][0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The float32 values (gguf-py's reference dequantization), `[out_features, in_features]`."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def read_block_matrices(gguf_path: str) -> dict[str, BlockMatrix]:
    """Every matrix of `gguf_path` stored in one of `BLOCK_TYPES`, by Hugging Face name (tensors of other types,
    the float norms for one, are left out)."""
    header = check_gguf(gguf_path)
    if header.endian != "<":
        raise ValueError(f"{gguf_path} is a big-endian GGUF; its blocks are read little-endian only")
    architecture = header.metadata.get("general.architecture")
    permute_qk = architecture == "llama"
    if permute_qk:
        num_heads = int(header.metadata[f"{architecture}.attention.head_count"])
        num_kv_heads = int(header.metadata.get(f"{architecture}.attention.head_count_kv", num_heads))
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    matrices = {}
    for tensor in header.tensors:
        if tensor.ggml_type not in BLOCK_TYPES or len(tensor.dims) != 2:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        _, block_values, block_bytes = BLOCK_TYPES[tensor.ggml_type]
        in_features, rows = tensor.dims  # GGUF lists the innermost dimension first
        row_bytes = in_features // block_values * block_bytes
        start = header.data_start + tensor.offset
        blocks = torch.from_numpy(np.array(data[start:start + rows * row_bytes], copy=True).reshape(rows, row_bytes))
        if permute_qk and name.endswith("q_proj.weight"):
            blocks = unpermute_rotary_rows(blocks, num_heads)
        elif permute_qk and name.endswith("k_proj.weight"):
            blocks = unpermute_rotary_rows(blocks, num_kv_heads)
        matrices[name] = BlockMatrix(tensor.ggml_type, blocks.contiguous(), in_features)
    return matrices


def source_gguf(model_dir: str) -> Optional[str]:
    """The GGUF file a converted directory was made from (its `radixserve_source.json`); None for other
    directories."""
    path = os.path.join(model_dir, "radixserve_source.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)["gguf_path"]
