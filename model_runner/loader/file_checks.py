"""Checks of a model file's header before any reader allocates from it: GGUF and safetensors.

A model file is input like a request: a file downloaded from a hub can declare a billion tensors, a dimension of
2**63, an offset past its end or a string longer than the file. The readers behind us (gguf's GGUFReader, the
safetensors library) then fail deep inside with an IndexError or an overflow, or allocate what the header asks for.
`check_gguf` and `check_safetensors` walk the header with every count, length, dimension and offset bounded by the
bytes the file really has, and raise ModelFileError naming the file and its defect; a file they pass is one the
readers can lay out without reading past its end. `check_gguf` also returns what it read (`GGUFHeader`), which the
GGUF block layers load from.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 used 32-bit counts and is not read by the gguf package either
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
GGUF_MAX_ARRAY_NESTING = 2  # an array of arrays at most (tokenizer merges are strings; nothing nests deeper)
# GGUF value types: (struct code, size) of the fixed-size ones; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9

SAFETENSORS_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


class ModelFileError(ValueError):
    """A model file whose header is malformed or promises more than the file holds."""

    def __init__(self, path: str, defect: str) -> None:
        super().__init__(f"{path}: {defect}")
        self.path = path
        self.defect = defect


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as the file lists them
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header as `check_gguf` read it: the scalar and string metadata (arrays, the tokenizer's
    vocabulary among them, are stepped over unread), the tensor table in file order and where the tensor data
    starts."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_start: int
    endian: str  # struct's "<" or ">"


class _Cursor:
    """Bounded reads from a memory-mapped file: every length is checked against the bytes left before it is read."""

    def __init__(self, data: mmap.mmap, path: str, endian: str = "<") -> None:
        self.data, self.path, self.size, self.endian, self.pos = data, path, len(data), endian, 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, defect: str) -> ModelFileError:
        return ModelFileError(self.path, f"not a valid GGUF file: {defect} (at byte {self.pos})")

    def skip(self, n: int, what: str) -> int:
        """Step over `n` bytes; their start."""
        if n > self.left:
            raise self.fail(f"{what} needs {n} bytes, the file has {self.left} left")
        self.pos += n
        return self.pos - n

    def scalar(self, code: str, what: str) -> int | float | bool:
        start = self.skip(struct.calcsize(code), what)
        return struct.unpack_from(self.endian + code, self.data, start)[0]

    def string(self, what: str, decode: bool = True) -> str:
        length = int(self.scalar("Q", f"the length of {what}"))
        start = self.skip(length, what)
        if not decode:
            return ""
        try:
            return self.data[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def check_gguf(path: str) -> GGUFHeader:
    """Raise ModelFileError unless `path` is a GGUF file whose header (metadata, tensor table) and tensor data fit
    in the file; reads the header only, and returns it."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    if size < 8:
        raise ModelFileError(path, f"not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data, path)
        if data[:4] != GGUF_MAGIC:
            raise ModelFileError(path, "not a GGUF file (it does not start with 'GGUF')")
        raw_version = data[4:8]
        cursor.skip(8, "the magic and version")
        version = struct.unpack("<I", raw_version)[0]
        if version not in GGUF_VERSIONS and struct.unpack(">I", raw_version)[0] in GGUF_VERSIONS:
            cursor.endian, version = ">", struct.unpack(">I", raw_version)[0]
        if version not in GGUF_VERSIONS:
            raise ModelFileError(path, f"GGUF version {version} is not supported (versions {GGUF_VERSIONS})")
        num_tensors = int(cursor.scalar("Q", "the tensor count"))
        num_fields = int(cursor.scalar("Q", "the metadata count"))
        # A field takes at least 13 bytes (key length, an empty key, type, a 1-byte value), a tensor entry 24.
        if num_fields * 13 > cursor.left:
            raise cursor.fail(f"{num_fields} metadata fields cannot fit in the {cursor.left} bytes left")
        if num_tensors * 24 > cursor.left:
            raise cursor.fail(f"{num_tensors} tensors cannot fit in the {cursor.left} bytes left")
        alignment = GGUF_DEFAULT_ALIGNMENT
        metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string("a metadata key")
            value = _gguf_value(cursor, int(cursor.scalar("I", f"the type of {key!r}")), key, depth=0)
            if value is not None:
                metadata[key] = value
            if key == "general.alignment":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
                    raise cursor.fail(f"general.alignment must be a positive power of two, got {value!r}")
                alignment = value
        tensors: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes)
        infos: list[GGUFTensorInfo] = []
        for _ in range(num_tensors):
            name = cursor.string("a tensor name")
            if name in tensors:
                raise cursor.fail(f"tensor {name!r} is listed twice")
            num_dims = int(cursor.scalar("I", f"the rank of {name!r}"))
            if not 1 <= num_dims <= GGUF_MAX_DIMS:
                raise cursor.fail(f"tensor {name!r} has {num_dims} dimensions (1 to {GGUF_MAX_DIMS})")
            dims = [int(cursor.scalar("Q", f"a dimension of {name!r}")) for _ in range(num_dims)]
            type_id = int(cursor.scalar("I", f"the type of {name!r}"))
            offset = int(cursor.scalar("Q", f"the offset of {name!r}"))
            try:
                block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise cursor.fail(f"tensor {name!r} has unknown ggml type {type_id}") from None
            if any(d == 0 for d in dims) or dims[0] % block_size:
                raise cursor.fail(f"tensor {name!r} has dimensions {dims}: each must be positive and the first a "
                                  f"multiple of its type's block of {block_size}")
            num_bytes = math.prod(dims) // block_size * block_bytes
            if num_bytes > size or offset > size or offset % alignment:
                raise cursor.fail(f"tensor {name!r} ({dims}, {num_bytes} bytes at offset {offset}) does not fit in "
                                  f"a {size}-byte file with {alignment}-byte alignment")
            tensors[name] = (offset, num_bytes)
            infos.append(GGUFTensorInfo(name, tuple(dims), type_id, offset))
        data_start = -(-cursor.pos // alignment) * alignment
        for name, (offset, num_bytes) in tensors.items():
            if data_start + offset + num_bytes > size:
                raise ModelFileError(path, f"not a valid GGUF file: tensor {name!r} ends at byte "
                                           f"{data_start + offset + num_bytes}, past the file's end ({size})")
    return GGUFHeader(metadata, infos, data_start, cursor.endian)


def _gguf_value(cursor: _Cursor, type_id: int, key: str, depth: int) -> object:
    if type_id in _GGUF_SCALARS:
        return cursor.scalar(_GGUF_SCALARS[type_id], f"the value of {key!r}")
    if type_id == _GGUF_STRING:
        return cursor.string(f"the value of {key!r}", decode=depth == 0)
    if type_id != _GGUF_ARRAY:
        raise cursor.fail(f"metadata {key!r} has unknown value type {type_id}")
    if depth >= GGUF_MAX_ARRAY_NESTING:
        raise cursor.fail(f"metadata {key!r} nests arrays deeper than {GGUF_MAX_ARRAY_NESTING}")
    item_type = int(cursor.scalar("I", f"the item type of {key!r}"))
    count = int(cursor.scalar("Q", f"the length of {key!r}"))
    item_bytes = struct.calcsize(_GGUF_SCALARS[item_type]) if item_type in _GGUF_SCALARS else 8
    if count * item_bytes > cursor.left:
        raise cursor.fail(f"metadata {key!r} declares {count} items, more than the {cursor.left} bytes left hold")
    if item_type in _GGUF_SCALARS:  # skipped in one read: only its size matters here
        cursor.skip(count * item_bytes, f"the items of {key!r}")
        return None
    for _ in range(count):
        _gguf_value(cursor, item_type, key, depth + 1)
    return None


def check_safetensors(path: str) -> None:
    """Raise ModelFileError unless `path` is a safetensors file whose JSON header is well formed and whose tensors
    tile its data exactly (each a known dtype, its byte range matching its shape, none past the end)."""
    size = os.path.getsize(path)

    def fail(defect: str) -> ModelFileError:
        return ModelFileError(path, f"not a valid safetensors file: {defect}")

    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise fail(f"{size} bytes, shorter than the 8-byte header length")
        header_bytes = struct.unpack("<Q", prefix)[0]
        if header_bytes > min(size - 8, SAFETENSORS_MAX_HEADER_BYTES):
            raise fail(f"the header declares {header_bytes} bytes; the file has {size - 8} after the length "
                       f"(limit {SAFETENSORS_MAX_HEADER_BYTES})")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise fail(f"the header is not JSON ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object")
    data_bytes = size - 8 - header_bytes
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise fail("__metadata__ must map strings to strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise fail(f"tensor {name!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise fail(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise fail(f"tensor {name!r} has shape {shape!r}: a list of non-negative integers is expected")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise fail(f"tensor {name!r} has data_offsets {offsets!r} outside the {data_bytes} data bytes")
        if math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise fail(f"tensor {name!r}: shape {shape} of {dtype} does not match its {offsets[1] - offsets[0]} "
                       "bytes")
        ranges.append((offsets[0], offsets[1], name))
    position = 0
    for start, end, name in sorted(ranges):
        if start != position:
            raise fail(f"tensor {name!r} starts at data byte {start}, expected {position} (gaps and overlaps "
                       "are refused)")
        position = end
    if position != data_bytes:
        raise fail(f"the tensors cover {position} of the {data_bytes} data bytes")
