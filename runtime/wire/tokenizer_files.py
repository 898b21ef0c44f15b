"""Load a model's tokenizer: the one thing every process needs of the model's files (the detokenizer nothing else).

Light: the standard library at import; `transformers` when a tokenizer is loaded; never torch for a plain
`tokenizer.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

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
