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
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

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
    header = read_gguf_header(gguf_path)
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


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as the file lists them
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's scalar metadata (arrays, the tokenizer's vocabulary among them, are skipped unread), its tensors
    and where their data starts."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_start: int


# GGUF metadata value types: the fixed-size scalars as struct codes; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_header(gguf_path: str) -> GGUFHeader:
    """The header of a GGUF file (version 2 or 3, little-endian), read in one pass. gguf-py's `GGUFReader` builds an
    object per element of every metadata array, which takes seconds on a 49k-token vocabulary; the block layers need
    a few scalars and the tensor table only."""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse_header(view, gguf_path)
        finally:
            view.release()


def _parse_header(view: memoryview, gguf_path: str) -> GGUFHeader:
    if bytes(view[:4]) != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", view, 4)
    if version not in (2, 3):
        raise ValueError(f"{gguf_path}: GGUF version {version} is not supported (2 and 3 are)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key, pos = _string(view, pos)
        (value_type,), pos = struct.unpack_from("<I", view, pos), pos + 4
        value, pos = _value(view, pos, value_type)
        if value is not _SKIPPED:
            metadata[key] = value
    tensors = []
    for _ in range(num_tensors):
        name, pos = _string(view, pos)
        (num_dims,), pos = struct.unpack_from("<I", view, pos), pos + 4
        dims = struct.unpack_from(f"<{num_dims}Q", view, pos)
        pos += 8 * num_dims
        ggml_type, offset = struct.unpack_from("<IQ", view, pos)
        pos += 12
        tensors.append(GGUFTensorInfo(name, tuple(dims), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    return GGUFHeader(metadata, tensors, -(-pos // alignment) * alignment)


_SKIPPED = object()


def _string(view: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", view, pos)
    pos += 8
    return bytes(view[pos:pos + length]).decode("utf-8"), pos + length


def _value(view: memoryview, pos: int, value_type: int) -> tuple[Any, int]:
    """A scalar or string value, or `_SKIPPED` for an array (the position moves past it either way)."""
    if value_type in _SCALARS:
        code = _SCALARS[value_type]
        return struct.unpack_from("<" + code, view, pos)[0], pos + struct.calcsize(code)
    if value_type == _STRING:
        return _string(view, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", view, pos)
    pos += 12
    if element_type in _SCALARS:
        return _SKIPPED, pos + count * struct.calcsize(_SCALARS[element_type])
    if element_type == _STRING:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", view, pos)
            pos += 8 + length
        return _SKIPPED, pos
    for _ in range(count):  # an array of arrays
        _, pos = _value(view, pos, element_type)
    return _SKIPPED, pos


def source_gguf(model_dir: str) -> Optional[str]:
    """The GGUF file a converted directory was made from (its `radixserve_source.json`); None for other
    directories."""
    path = os.path.join(model_dir, "radixserve_source.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)["gguf_path"]
