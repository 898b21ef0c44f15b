"""Malicious model files (model_runner/loader/file_checks.py): GGUF and safetensors headers with absurd counts,
dimensions, offsets and lengths end in a ModelFileError that names the file and its defect, never in an
IndexError or overflow from a reader, an allocation the file cannot back, or a hang.

The fuzz tests take a small valid file (written by the gguf package's GGUFWriter, or safetensors' save_file),
corrupt its header (structured: counts, dimensions, offsets, types; or raw: bytes overwritten, the file cut), and
require of every result: either the check refuses it with a ModelFileError, or the library reader opens it and
reads every tensor. The suite runs 150 examples of each; `RADIXSERVE_FUZZ_EXAMPLES=N` runs N (docs/security.md
has the figures of a run of about two minutes per format).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.model_runner.loader.file_checks import ModelFileError, check_gguf, check_safetensors
from radixserve.model_runner.loader.gguf_convert import convert_gguf

FUZZ_EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "150"))
# No per-example deadline: on a loaded machine one example can stall for seconds; the module timeout catches a hang.
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.timeout(900)
UINT64 = st.integers(0, 2**64 - 1)
INTERESTING = st.sampled_from([0, 1, 2, 3, 4, 5, 31, 32, 33, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1])


def tiny_gguf(path: str) -> None:
    """A two-tensor GGUF file with a string array and scalars, as the converter reads."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny.gguf")
        tiny_gguf(path)
        with open(path, "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def safetensors_bytes() -> bytes:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny.safetensors")
        save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.int64)},
                  path, metadata={"format": "pt"})
        with open(path, "rb") as f:
            return f.read()


def gguf_tensor_table_start(data: bytes) -> int:
    """Where the tiny file's tensor table begins (after the metadata), found by walking the header."""
    from gguf import GGUFReader

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        reader = GGUFReader(f.name)
        return int(reader.tensors[0].field.offset)


def gguf_header(version: int, num_tensors: int, num_fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_fields)


def tensor_entry(name: bytes, dims: list[int], type_id: int, offset: int) -> bytes:
    return (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset))


def assert_gguf_refused_or_readable(path: str) -> None:
    from gguf import GGUFReader

    try:
        check_gguf(path)
    except ModelFileError as error:
        assert error.path == path and str(error).startswith(path) and error.defect
        return
    reader = GGUFReader(path)  # what the check passes, the reader lays out and reads whole
    for tensor in reader.tensors:
        np.asarray(tensor.data).sum()


def assert_safetensors_refused_or_readable(path: str) -> None:
    from safetensors import safe_open

    try:
        check_safetensors(path)
    except ModelFileError as error:
        assert error.path == path and str(error).startswith(path) and error.defect
        return
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            f.get_tensor(name).sum()


def write(tmp_path, name: str, data: bytes) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# ---- GGUF --------------------------------------------------------------------------------------------------------

def test_the_files_the_loader_writes_and_ships_pass(gguf_bytes, safetensors_bytes, tmp_path):
    from radixserve.runtime.model_files import default_model_path

    check_gguf(write(tmp_path, "tiny.gguf", gguf_bytes))
    check_gguf(default_model_path())
    check_safetensors(write(tmp_path, "tiny.safetensors", safetensors_bytes))


@pytest.mark.parametrize("num_tensors,num_fields,defect", [
    (2**40, 0, "tensors cannot fit"),
    (0, 2**63, "metadata fields cannot fit"),
    (2**64 - 1, 2**64 - 1, "cannot fit"),
])
def test_absurd_counts_name_the_defect(tmp_path, num_tensors, num_fields, defect):
    path = write(tmp_path, "counts.gguf", gguf_header(3, num_tensors, num_fields) + b"\0" * 64)
    with pytest.raises(ModelFileError, match=defect):
        check_gguf(path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelFileError, match=defect):  # the converter checks before its reader runs
        convert_gguf(path, str(out))


@pytest.mark.parametrize("dims,type_id,offset,defect", [
    ([2**63, 2**63], 0, 0, "does not fit"),
    ([0], 0, 0, "must be positive"),
    ([8, 8, 8, 8, 8], 0, 0, "5 dimensions"),
    ([8], 9999, 0, "unknown ggml type"),
    ([8], 0, 2**64 - 32, "does not fit"),
    ([8], 0, 3, "does not fit"),  # unaligned
    ([24], 0, 0, "past the file's end"),
    ([33], 2, 0, "multiple of its type's block"),  # Q4_0 blocks of 32
])
def test_absurd_tensor_entries_name_the_defect(tmp_path, dims, type_id, offset, defect):
    data = gguf_header(3, 1, 0) + tensor_entry(b"t", dims, type_id, offset)
    path = write(tmp_path, "tensor.gguf", data + b"\0" * (-len(data) % 32) + b"\0" * 64)
    with pytest.raises(ModelFileError, match=defect):
        check_gguf(path)


def test_strings_and_arrays_longer_than_the_file_are_refused(tmp_path):
    key = b"k"
    field = struct.pack("<Q", len(key)) + key
    cases = {
        "string": field + struct.pack("<IQ", 8, 2**62),
        "array": field + struct.pack("<IIQ", 9, 4, 2**61),
        "nested": field + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 1),
        "value type": field + struct.pack("<I", 77),
    }
    for name, body in cases.items():
        path = write(tmp_path, f"{name}.gguf", gguf_header(3, 0, 1) + body + b"\0" * 16)
        with pytest.raises(ModelFileError):
            check_gguf(path)


@FUZZ
@given(data=st.data())
def test_fuzzed_gguf_headers_are_refused_or_readable(gguf_bytes, tmp_path_factory, data):
    blob = bytearray(gguf_bytes)
    table = gguf_tensor_table_start(gguf_bytes)
    kind = data.draw(st.sampled_from(["counts", "tensor", "bytes", "cut"]))
    if kind == "counts":
        struct.pack_into("<QQ", blob, 8, data.draw(st.one_of(INTERESTING, UINT64)),
                         data.draw(st.one_of(INTERESTING, UINT64)))
    elif kind == "tensor":  # rewrite the first tensor's entry: rank, dimensions, type, offset
        name_len = struct.unpack_from("<Q", blob, table)[0]
        rank_at = table + 8 + name_len
        dims = data.draw(st.lists(st.one_of(INTERESTING, UINT64), min_size=0, max_size=6))
        entry = struct.pack("<I", data.draw(st.one_of(st.just(len(dims)), st.integers(0, 2**32 - 1))))
        entry += b"".join(struct.pack("<Q", d) for d in dims)
        entry += struct.pack("<IQ", data.draw(st.integers(0, 2**32 - 1) | st.integers(0, 40)),
                             data.draw(st.one_of(INTERESTING, UINT64)))
        old_len = 4 + 8 * 2 + 4 + 8  # the tiny file's first tensor is 2-D
        blob[rank_at:rank_at + old_len] = entry
    elif kind == "bytes":
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, min(len(blob), table + 200) - 1))
            blob[at] = data.draw(st.integers(0, 255))
    else:
        del blob[data.draw(st.integers(0, len(blob) - 1)):]
    assert_gguf_refused_or_readable(write(tmp_path_factory.mktemp("gguf"), "fuzz.gguf", bytes(blob)))


# ---- safetensors -------------------------------------------------------------------------------------------------

def safetensors_with_header(header: object, data: bytes, declared: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw + data


@pytest.mark.parametrize("header,data,declared,defect", [
    ({}, b"", 2**63, "header declares"),
    (b"[1, 2", b"", None, "not JSON"),
    ([1], b"", None, "not a JSON object"),
    ({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, b"\0" * 8, None, "does not match"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2**63]}}, b"\0" * 8, None, "outside"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative"),
    ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"k": 1}}, b"\0" * 8, None,
     "__metadata__"),
])
def test_absurd_safetensors_headers_name_the_defect(tmp_path, header, data, declared, defect):
    path = write(tmp_path, "bad.safetensors", safetensors_with_header(header, data, declared))
    with pytest.raises(ModelFileError, match=defect):
        check_safetensors(path)


JSON_NUMBER = st.one_of(INTERESTING, st.integers(-(2**64), 2**64), st.floats(allow_nan=False), st.none(), st.text())


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_headers_are_refused_or_readable(safetensors_bytes, tmp_path_factory, data):
    header_len = struct.unpack_from("<Q", safetensors_bytes)[0]
    header = json.loads(safetensors_bytes[8:8 + header_len])
    payload = safetensors_bytes[8 + header_len:]
    kind = data.draw(st.sampled_from(["entry", "declared", "bytes", "cut"]))
    if kind == "entry":
        name = data.draw(st.sampled_from(["a", "b"]))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        if field == "dtype":
            header[name][field] = data.draw(st.sampled_from(["F32", "I64", "BF16", "F8_E4M3", "BOOL", "X"]) | st.text())
        elif field == "extra":
            header[name] = data.draw(st.dictionaries(st.text(max_size=12), JSON_NUMBER, max_size=4))
        else:
            header[name][field] = data.draw(st.lists(JSON_NUMBER, max_size=5) | JSON_NUMBER)
        blob = safetensors_with_header(header, payload)
    elif kind == "declared":
        blob = safetensors_with_header(header, payload, declared=data.draw(st.one_of(INTERESTING, UINT64)))
    elif kind == "bytes":
        blob = bytearray(safetensors_bytes)
        for _ in range(data.draw(st.integers(1, 8))):
            blob[data.draw(st.integers(0, 8 + header_len - 1))] = data.draw(st.integers(0, 255))
        blob = bytes(blob)
    else:
        blob = safetensors_bytes[:data.draw(st.integers(0, len(safetensors_bytes) - 1))]
    assert_safetensors_refused_or_readable(write(tmp_path_factory.mktemp("st"), "fuzz.safetensors", blob))
