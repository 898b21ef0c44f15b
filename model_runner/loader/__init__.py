"""Model loading: resolve a model argument to a Hugging Face directory, then stream its weights.

    resolved = resolve_model(None)                  # the embedded default GGUF, converted once and cached
    config = ModelConfig.from_path(resolved.model_dir)
    weights = iter_weights(resolved.model_dir) if resolved.load_format == "safetensors" else dummy_weights(config)
    tokenizer = load_tokenizer(resolved.model_dir)
"""

from radixserve.model_runner.loader.gguf_convert import GGUFConversionError, converted_gguf_dir
from radixserve.model_runner.loader.resolve import (
    ModelNotFoundError,
    ResolvedModel,
    default_cache_dir,
    default_model_path,
    resolve_model,
)
from radixserve.model_runner.loader.tokenizer import load_tokenizer
from radixserve.model_runner.loader.weights import dummy_weights, iter_weights

__all__ = [
    "GGUFConversionError",
    "ModelNotFoundError",
    "ResolvedModel",
    "converted_gguf_dir",
    "default_cache_dir",
    "default_model_path",
    "dummy_weights",
    "iter_weights",
    "load_tokenizer",
    "resolve_model",
]
