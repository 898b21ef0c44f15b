"""The model's files, resolved once at launch: `resolve_model` finds them (runtime/wire/model_files.py) and converts a
GGUF into the cache the first time it is seen, so the processes started after it only locate the conversion.

No torch until a GGUF must be converted.
"""

from __future__ import annotations

from typing import Optional

from radixserve.runtime.wire.model_files import (
    DEFAULT_MODEL_FILE, ModelFiles, ModelNotFoundError, default_cache_dir, default_model_path, locate_model,
)
from radixserve.runtime.wire.tokenizer_files import load_tokenizer, server_tokenizer

# Also the names their importers know from here (the light ones live in the wire).
__all__ = ["DEFAULT_MODEL_FILE", "ModelFiles", "ModelNotFoundError", "default_cache_dir", "default_model_path",
           "load_tokenizer", "resolve_model", "server_tokenizer"]


def resolve_model(
    model_path: Optional[str] = None, load_format: str = "auto", cache_dir: Optional[str] = None
) -> ModelFiles:
    """`locate_model`, converting a GGUF into `cache_dir` (default ~/.cache/radixserve) when it is not there yet;
    later resolves reuse the cached directory."""
    return locate_model(model_path, load_format, cache_dir, convert=_convert_gguf)


def _convert_gguf(gguf_path: str, cache_dir: str) -> str:
    from radixserve.model_runner.loader.gguf_convert import converted_gguf_dir  # torch: only to convert

    return converted_gguf_dir(gguf_path, cache_dir)
