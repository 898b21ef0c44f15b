"""Which `--quantization` the runner applies when none was asked: a GGUF model on the CPU decodes on its own blocks
(`gguf`, model_runner/cpu/gguf_linear.py) on CPUs where that measured faster than the float path end to end and
keeps its greedy output, and runs on its float conversion everywhere else.

The rule, by `cpu_isa()`: the blocks by default on CPUs with one of `GGUF_DEFAULT_ISA_FLAGS`. Where the CPU also has
AVX-512 VNNI, Q4_0 / Q4_1 / Q8_0 blocks are interleaved (model_runner/cpu/gguf_linear.py) and serve every row count,
faster than the float path at each, and no float weight stays. Other blocks serve the decode rows only: each such
projection keeps its float32 linear for prefill rows (`keep_float`), so a prompt costs what it costs on the float path,
and memory grows by the blocks alone. On the AVX-512 CPU measured (2-core AMD EPYC, avx512f, avx512_bf16 and
avx512_vnni; the embedded SmolLM2's Q4_1 blocks, interleaved), side by side in one run: see docs/quantization.md
("The CPU default for a GGUF model") and benchmarks/gguf_default.py. The interleaved blocks keep the float path's
greedy ids on 15 of 16 prompts; the others multiply float32 activations, the float path's function up to summation
order. CPUs without AVX-512 keep the float path until measured.

The float path stays wherever something asked for it or needs float weights: `--quantization none`, any `--dtype`
but auto, `--cpu-kernels torch`, LoRA adapters, tensor parallelism, speculative decoding (the verify steps' packed
float linears), deterministic inference (the blocks' kernel changes its summation at prefill row counts), embedding
models, dummy weights, a model that is not a GGUF file, and a machine where the C++ kernels do not build.
"""

from __future__ import annotations

import logging
from typing import Optional

from radixserve.kernels import cpu_build
from radixserve.runtime.wire.model_files import ModelFiles
from radixserve.runtime.wire.quantization import NO_QUANTIZATION
from radixserve.runtime.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)

# `cpu_isa()` flags of the CPUs where a GGUF model runs on its blocks by default (see the module docstring).
GGUF_DEFAULT_ISA_FLAGS: tuple[str, ...] = ("avx512f",)


def blocks_by_default(args: ServerArgs, model: ModelFiles) -> bool:
    """Whether a GGUF model runs on its blocks though `args` asked for no quantization (see the module docstring)."""
    if args.quantization is not None or model.load_format == "dummy" or not model.source.endswith(".gguf"):
        return False
    float_needed = (args.resolved_device() != "cpu" or args.dtype != "auto" or args.cpu_kernels == "torch"
                    or args.lora_enabled() or args.tp_size != 1 or args.speculative_algorithm is not None
                    or args.enable_deterministic_inference or args.is_embedding)
    if float_needed or not set(GGUF_DEFAULT_ISA_FLAGS) & set(cpu_build.cpu_isa().split(",")):
        return False
    if not cpu_build.load():  # built once per machine (make setup); a failed build keeps the float path
        logger.warning("the GGUF blocks' kernels are unavailable; %s runs on its float32 conversion", model.source)
        return False
    return True


def resolved_quantization(args: ServerArgs, model: ModelFiles) -> Optional[str]:
    """The quantization the runner applies: the one asked (`none`: None), else `gguf` where `blocks_by_default`."""
    if args.quantization == NO_QUANTIZATION:
        return None
    if args.quantization is not None:
        return args.quantization
    return "gguf" if blocks_by_default(args, model) else None
