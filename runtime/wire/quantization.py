"""`--quantization`: SGLang's names for quantized weight formats, and which of them radixserve runs (light: read by
ServerArgs and by the runner).

    gguf    a GGUF model's linear layers compute on the file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), kept
            packed, with the C++ CPU kernel kernels/cpu_gguf_linear.cpp; CPU only. Unasked, the runner chooses it for
            a GGUF model on CPUs where it measured faster (model_runner/cpu/gguf_default.py)
    none    the model's dtype, even where the runner would choose gguf

Every other SGLang value is refused with the reason, never ignored: a checkpoint quantized in one of those formats
would otherwise load as something it is not.
"""

from __future__ import annotations

from typing import Optional

QUANTIZATION_METHODS = ("gguf",)
NO_QUANTIZATION = "none"  # asked for the model's dtype: the runner chooses no quantization on its own

_NO_GPU_KERNEL = "need GPU GEMM kernels that radixserve does not have yet"
# SGLang 0.5's --quantization values that radixserve recognizes but does not run, with the reason.
UNSUPPORTED_QUANTIZATION: dict[str, str] = {
    "fp8": f"FP8 weights (checkpoints or online quantization) {_NO_GPU_KERNEL}",
    "compressed-tensors": f"compressed-tensors checkpoints (FP8, W4A16) {_NO_GPU_KERNEL}",
    "awq": f"AWQ checkpoints {_NO_GPU_KERNEL}",
    "awq_marlin": f"AWQ checkpoints {_NO_GPU_KERNEL}",
    "gptq": f"GPTQ checkpoints {_NO_GPU_KERNEL}",
    "gptq_marlin": f"GPTQ checkpoints {_NO_GPU_KERNEL}",
    "marlin": f"Marlin weights {_NO_GPU_KERNEL}",
    "mxfp4": f"MXFP4 experts {_NO_GPU_KERNEL}",
    "w8a8_fp8": f"W8A8 FP8 checkpoints {_NO_GPU_KERNEL}",
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
        known = ", ".join((*QUANTIZATION_METHODS, *UNSUPPORTED_QUANTIZATION))
        raise ValueError(f"unknown quantization {method!r}; SGLang's names are {known} "
                         f"(radixserve runs: {', '.join(QUANTIZATION_METHODS)})")
    if device != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only (its kernels are C++ CPU kernels); "
                         f"got device {device!r}")
    if dtype != "float32":
        raise ValueError(f"quantization {method!r} computes in float32 around its blocks; drop --dtype {dtype}")
    if tp_size != 1:
        raise ValueError(f"quantization {method!r} runs on one rank (tp_size 1), got tp_size {tp_size}")
    if gguf_model is False:
        raise ValueError(f"quantization {method!r} keeps a GGUF file's blocks: the model must be a .gguf file")
