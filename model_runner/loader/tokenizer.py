"""Tokenizer loading: a transformers fast tokenizer (with its chat template) from a model directory."""

from __future__ import annotations

import os


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """Load the fast tokenizer of a Hugging Face directory, or of a `.gguf` file (built from its metadata).

    Extra keyword arguments go to `AutoTokenizer.from_pretrained`. Raises ValueError if only a slow
    (Python) tokenizer is available: the runtime relies on the Rust tokenizer for speed and offsets.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        kwargs.setdefault("gguf_file", os.path.basename(path))
        path = os.path.dirname(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if not tokenizer.is_fast:
        raise ValueError(f"no fast tokenizer for {path} (tokenizer.json missing?)")
    return tokenizer
