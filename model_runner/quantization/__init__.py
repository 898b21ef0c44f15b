"""Quantized linear layers for FP8 and 4-bit checkpoints (GPU kernels, CPU reference): see methods.py for the formats,
linear.py for the layer, loader.py for how a checkpoint's tensors reach it."""

from radixserve.model_runner.quantization.linear import QuantizedLinear
from radixserve.model_runner.quantization.loader import QuantizedWeightLoader, quantize_model
from radixserve.model_runner.quantization.methods import LinearMethod, quantization_method

__all__ = ["LinearMethod", "QuantizedLinear", "QuantizedWeightLoader", "quantization_method", "quantize_model"]
