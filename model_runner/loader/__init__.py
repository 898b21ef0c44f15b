"""Model loading: stream a resolved model's weights (resolving the model argument and loading the tokenizer
live in the light `radixserve.runtime.model_files`, which every process can import).

    resolved = resolve_model(None)                  # runtime.model_files: the embedded GGUF, converted once
    config = ModelConfig.from_path(resolved.model_dir)
    weights = iter_weights(resolved.model_dir) if resolved.load_format == "safetensors" else dummy_weights(config)
"""

from radixserve.model_runner.loader.gguf_convert import GGUFConversionError, converted_gguf_dir
from radixserve.model_runner.loader.weights import dummy_weights, iter_weights

__all__ = ["GGUFConversionError", "converted_gguf_dir", "dummy_weights", "iter_weights"]
