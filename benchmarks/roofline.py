"""Timing and floors for the batch benchmarks: device ceilings measured in the same run, bytes and FLOPs of
a model's forward pass, and a timer that uses CUDA events on a GPU.

Floors: a decode step must at least read every weight it multiplies by plus the KV cache of its context,
so its floor is `(weight bytes + KV bytes read) / copy bandwidth`; a prefill must at least do its matmul
FLOPs, so its floor is `FLOPs / matmul rate` (or the weight read, if longer). The bandwidth counts the bytes
a device-to-device copy reads plus writes; the matmul rate is that of one large square matmul.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

COPY_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}  # well past the last-level cache
MATMUL_SIZE = {"cuda": 8192, "cpu": 512}


# ---- timing ----------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, calls: int = 1) -> float:
    """Milliseconds from an idle device to the end of `calls` back-to-back calls of `fn`, divided by
    `calls`: with calls=1 the latency of one call, host work included; with more, the time per call once
    the host runs ahead of the device. CUDA events on a GPU, the wall clock on the CPU."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) * 1e3 / calls


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median latency of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    return statistics.median(time_ms(fn, device) for _ in range(repeats))


# ---- device ceilings -------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second read plus written by a device-to-device copy (median of 10)."""
    nbytes = COPY_BYTES[device.type]
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats=10, warmup=3)
    return 2 * nbytes / (ms * 1e-3)


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one square matmul of MATMUL_SIZE in `dtype` (median of 10)."""
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = median_ms(lambda: a @ b, device, repeats=10, warmup=3)
    return 2 * n**3 / (ms * 1e-3)


# ---- bytes and FLOPs of a model --------------------------------------------------------------------

def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def expert_share(config, tokens: int) -> float:
    """The share of a mixture-of-experts layer's experts that `tokens` routed tokens read, the routing spread evenly
    (as random weights spread it): `1 - (1 - k/E)^tokens`; 1 for a dense model."""
    moe = getattr(config, "moe", None)
    return 1.0 if moe is None else 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens


def weight_bytes_read_per_decode_step(model: nn.Module, batch_size: int = 1) -> int:
    """Bytes of every parameter a decode step of `batch_size` requests reads: all of them except an untied input
    embedding table, of which a step gathers only the batch's rows (a tied table is read whole as the LM head), and
    of a mixture of experts only the experts the batch visits (`expert_share`)."""
    share = expert_share(model.config, batch_size)
    total = sum(_bytes(p) * (share if ".experts." in name else 1.0) for name, p in model.named_parameters())
    # A quantized linear (model_runner/quantization/) holds its weight and scales as buffers named q_*.
    total += sum(_bytes(b) for name, b in model.named_buffers() if name.rsplit(".", 1)[-1].startswith("q_"))
    tied = getattr(model, "lm_head", None) is None
    return int(total if tied else total - _bytes(model.model.embed_tokens.weight))


def prefill_flops(model: nn.Module, batch_size: int, input_len: int) -> int:
    """Matmul FLOPs of prefilling `batch_size` requests of `input_len` new tokens each (no cached
    prefix), logits at each request's last token: projections, causal attention and the LM head."""
    config = model.config
    moe = getattr(config, "moe", None)
    visited = 1.0 if moe is None else moe.top_k / moe.num_experts  # each token runs k of a layer's E experts
    layer_params = int(sum(p.numel() * (visited if ".experts." in name else 1.0)
                           for name, p in model.model.layers.named_parameters()))
    layer_params += sum(m.in_features * m.out_features for m in model.model.layers.modules()
                        if hasattr(m, "weight_value"))  # quantized linears: their weights are buffers
    tokens = batch_size * input_len
    projections = 2 * layer_params * tokens
    # Q.K^T and P.V over the causal triangle: 2 matmuls x 2 FLOPs per multiply-add.
    pairs = batch_size * input_len * (input_len + 1) // 2
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * pairs
    lm_head = 2 * config.hidden_size * config.vocab_size * batch_size
    return projections + attention + lm_head
