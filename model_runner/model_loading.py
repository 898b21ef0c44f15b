"""The runner's model, built and loaded once at start-up.

`load_model` builds the model on the meta device (no memory, no random init), swaps in quantized linears when asked,
allocates it once on the runner's device, loads its weights (or dummy ones), then prepares its linears for the
kernels the device runs: a GGUF file's blocks, packed CPU layouts (model_runner/cpu/), batch-invariant GPU linears
(model_runner/batch_invariant.py) or the skinny GEMM for the decode shapes cuBLAS streams slowly
(model_runner/skinny_linear.py). It is given the ModelRunner under construction and reads its config, device,
dtype, tensor-parallel group, context length, CPU kernels and pooling; the weights themselves are read by
model_runner/loader/.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from radixserve.model_runner.batch_invariant import use_batch_invariant_linears
from radixserve.model_runner.cpu.gguf_linear import use_gguf_blocks
from radixserve.model_runner.cpu.packed import pack_cpu_linears
from radixserve.model_runner.cpu.small_batch import pack_small_batch_linears, small_batch_packing_pays
from radixserve.model_runner.fused_decode import use_fused_decode_layers
from radixserve.model_runner.loader import dummy_weights, iter_weights
from radixserve.model_runner.loader.gguf_blocks import source_gguf
from radixserve.model_runner.models import get_model_class
from radixserve.model_runner.moe import use_batch_invariant_experts
from radixserve.model_runner.quantization import QuantizedWeightLoader, quantization_method, quantize_model
from radixserve.model_runner.skinny_linear import use_skinny_linears

if TYPE_CHECKING:
    from radixserve.runtime.wire.model_files import ModelFiles

logger = logging.getLogger(__name__)


def load_model(runner: Any, files: ModelFiles, quantized_experts: Optional[bool] = None) -> torch.nn.Module:
    """The runner's model, built and loaded. `quantized_experts`: whether a quantized checkpoint's experts (of a
    mixture of experts) stay quantized (default: on CUDA, where the fused MoE kernels read them;
    model_runner/quantization/loader.py)."""
    model_class = get_model_class(runner.model_config.architecture)
    # Build on the meta device (no memory, no random init), then allocate on the target device once.
    with torch.device("meta"):
        model = model_class(runner.model_config, max_positions=runner.context_len, tp=runner.tp)
    model = model.to(runner.dtype)
    method = quantization_method(runner.config.quantization, runner.model_config.hf_config, runner.dtype)
    quantized_experts = runner.device.type == "cuda" if quantized_experts is None else quantized_experts
    if method is not None:  # FP8 / 4-bit linears (model_runner/quantization/), swapped in before allocation
        quantize_model(model, method, quantized_experts)
        logger.info("quantized linears: %s", method.describe())
    elif quantized_experts and hasattr(model, "keep_experts_quantized"):
        held = model.keep_experts_quantized(runner.model_config.hf_config)
        if held:
            logger.info(held)
    model = model.to_empty(device=runner.device)
    if files.load_format == "dummy":
        shapes = model.hf_weight_shapes() if hasattr(model, "hf_weight_shapes") else None
        weights = dummy_weights(runner.model_config, runner.config.random_seed, runner.dtype, runner.device, shapes)
    else:
        weights = iter_weights(files.model_dir, lazy=runner.tp.size > 1)
    with torch.no_grad():
        if method is None:
            model.load_weights(weights)
        else:
            dense = files.load_format == "dummy" or "quantization_config" not in runner.model_config.hf_config
            QuantizedWeightLoader(model, method, dense, runner.device).load(weights)
            if runner.device.type == "cuda":  # the 16-bit tensors quantized at load leave the allocator's cache
                torch.cuda.empty_cache()
    model.eval().requires_grad_(False)
    if runner.config.quantization == "gguf":
        gguf_path = source_gguf(files.model_dir)
        if gguf_path is None or files.load_format == "dummy":
            raise ValueError(f"quantization 'gguf' computes on a GGUF file's blocks; {files.source} is not a GGUF "
                             "file loaded with its weights")
        # before packing: the float linears left (and those kept for prefill) are packed as usual
        use_gguf_blocks(model, gguf_path, runner.config.gguf_activations, keep_float=runner.config.gguf_keep_float)
    if runner.device.type == "cpu" and runner.dtype == torch.bfloat16:
        # the weights are final now; see model_runner/cpu/packed.py. A model that only pools never runs its LM head.
        pack_cpu_linears(model, runner.cpu_kernels, lm_head=runner.pooling.is_generation)
    elif runner.device.type == "cpu" and runner.dtype == torch.float32:
        packed = small_batch_packing_pays(model, runner.config.speculative)
        pack_small_batch_linears(model, runner.cpu_kernels, packed=packed,  # see model_runner/cpu/small_batch.py
                                 lm_head=runner.pooling.is_generation)
    elif runner.device.type == "cuda" and runner.config.deterministic:
        use_batch_invariant_linears(model)  # see model_runner/batch_invariant.py
    elif runner.device.type == "cuda":
        skinny = use_skinny_linears(model)  # see model_runner/skinny_linear.py
        if skinny:
            logger.info("%d 16-bit linears take the skinny GEMM at decode rows", len(skinny))
    if runner.device.type == "cpu" and runner.config.deterministic:
        use_batch_invariant_experts(model)  # see model_runner/moe/grouped.py
    if runner.config.quantization == "gguf" and use_fused_decode_layers(model):
        logger.info("decode batches of a few tokens run every layer in one call (model_runner/fused_decode.py)")
    return model
