"""Model loading: stream a located model's weights (where the files are is the light
`radixserve.runtime.wire.model_files`, which every process can import; the launch converts a GGUF once).

    files = resolve_model(None)                     # runtime.model_files: the embedded GGUF, converted once
    config = ModelConfig.from_path(files.model_dir)
    weights = iter_weights(files.model_dir) if files.load_format == "safetensors" else dummy_weights(config)
"""

from radixserve.model_runner.loader.gguf_convert import GGUFConversionError, converted_gguf_dir
from radixserve.model_runner.loader.weights import dummy_weights, iter_weights

__all__ = ["GGUFConversionError", "converted_gguf_dir", "dummy_weights", "iter_weights"]
