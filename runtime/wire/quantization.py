"""`--quantization`: SGLang's names for quantized weight formats, and which of them radixserve runs (light: read by
ServerArgs and by the runner).

    gguf                a GGUF model's linear layers compute on the file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
                        Q6_K), kept packed, with the C++ CPU kernel kernels/cpu_gguf_linear.cpp; CPU only. Unasked,
                        the runner chooses it for a GGUF model on CPUs where it measured faster
                        (model_runner/cpu/gguf_default.py; none yet)
    none                the model's dtype, even where the runner would choose gguf
    fp8                 a checkpoint's FP8 weights (Hugging Face `fp8`: per tensor or 128x128 blocks), or a 16-bit
                        checkpoint quantized to FP8 at load, one scale per weight and per call of the activations
    w8a8_fp8            a 16-bit checkpoint quantized to FP8 at load per output channel, activations per token
    compressed-tensors  FP8 (per tensor, channel or block, dynamic per-token activations) and W4A16 pack-quantized
    awq, gptq           4-bit grouped weights (AWQ's GEMM layout; GPTQ with or without act-order), 16-bit activations
    mxfp4               gpt-oss's MXFP4 experts (the checkpoint's own format, read without the flag too): held exactly
                        as FP8 with a scale per 32 values on CUDA, dequantized to the model's dtype on the CPU

The five from fp8 to gptq run the attention and MLP projections through model_runner/quantization/ (cuBLASLt and Triton kernels
on CUDA, a float reference on the CPU); a checkpoint's own `quantization_config` picks its format without the flag.

SGLang's `awq_marlin` and `gptq_marlin` name AWQ and GPTQ checkpoints run on the Marlin kernels: the same weights and
the same function, another kernel. ServerArgs reads them as `awq` and `gptq` (`QUANTIZATION_ALIASES`), which run that
function on radixserve's own W4A16 kernels.

Every other SGLang value is refused with the reason, never ignored: a checkpoint quantized in one of those formats
would otherwise load as something it is not.
"""

from __future__ import annotations

from typing import Optional

QUANTIZATION_METHODS = ("gguf", "fp8", "w8a8_fp8", "compressed-tensors", "awq", "gptq", "mxfp4")
NO_QUANTIZATION = "none"  # asked for the model's dtype: the runner chooses no quantization on its own

# SGLang's names of a checkpoint format run on another kernel -> the format radixserve runs (module docstring).
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}

_NO_GPU_KERNEL = "need GPU GEMM kernels that radixserve does not have yet"
# SGLang 0.5's --quantization values that radixserve recognizes but does not run, with the reason.
UNSUPPORTED_QUANTIZATION: dict[str, str] = {
    "marlin": f"Marlin-serialized weights {_NO_GPU_KERNEL} (AWQ and GPTQ checkpoints run with awq_marlin / "
              "gptq_marlin, read as awq / gptq)",
    "w8a8_int8": f"W8A8 INT8 checkpoints {_NO_GPU_KERNEL}",
    "modelopt": f"ModelOpt checkpoints {_NO_GPU_KERNEL}",
    "modelopt_fp4": f"ModelOpt FP4 checkpoints {_NO_GPU_KERNEL}",
    "modelopt_fp8": f"ModelOpt FP8 checkpoints {_NO_GPU_KERNEL}",
    "moe_wna16": f"WNA16 experts {_NO_GPU_KERNEL}",
    "bitsandbytes": "bitsandbytes weights are not supported",
    "qoq": "QoQ weights are not supported",
    "w4afp8": f"W4AFP8 checkpoints {_NO_GPU_KERNEL}",
}


def check_quantization(method: Optional[str], device: str, dtype: str, tp_size: int, gguf_model: Optional[bool]) -> None:
    """Raise ValueError, with the reason, unless `method` (None: not asked) can run on `device` with activations of
    `dtype` on `tp_size` ranks for this model (`gguf_model`: whether the model is a GGUF file; None where not known
    yet)."""
    if method is None or method == NO_QUANTIZATION:
        return
    if method in UNSUPPORTED_QUANTIZATION:
        raise ValueError(f"quantization {method!r} is not supported: {UNSUPPORTED_QUANTIZATION[method]} "
                         f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    if method not in QUANTIZATION_METHODS:
        known = ", ".join((*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES, *UNSUPPORTED_QUANTIZATION))
        raise ValueError(f"unknown quantization {method!r}; SGLang's names are {known} "
                         f"(radixserve runs: {', '.join(QUANTIZATION_METHODS)})")
    if method != "gguf":
        return  # the checkpoint's quantization_config decides the rest when the model loads
    if device != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only (its kernels are C++ CPU kernels); "
                         f"got device {device!r}")
    if dtype != "float32":
        raise ValueError(f"quantization {method!r} computes in float32 around its blocks; drop --dtype {dtype}")
    if tp_size != 1:
        raise ValueError(f"quantization {method!r} runs on one rank (tp_size 1), got tp_size {tp_size}")
    if gguf_model is False:
        raise ValueError(f"quantization {method!r} keeps a GGUF file's blocks: the model must be a .gguf file")
