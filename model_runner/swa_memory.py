"""Hybrid memory for sliding-window models: whether the window layers get a slot space of their own, and its size.

The memory budget the KV pool would take under the full layout (every layer keeps every token) is split between full
slots (every layer's KV in the full-attention layers) and window slots (the window layers' KV), with
`--swa-full-tokens-ratio` window slots per full slot, SGLang's meaning: F full slots and r * F window slots cost what
`F * full-layer bytes + r * F * window-layer bytes` does, equal to the full layout's bytes. A model whose windowed
layers are most of its layers (Gemma 3: five of six) then holds several times more tokens in its full slots, while
the window slots hold the last W positions of every running request.

The split applies to models with windowed layers unless `--disable-hybrid-swa-memory`; it is left out (the log says
why) with page sizes above 1, speculative decoding and a hybrid linear-attention model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from radixserve.radix_cache.pool import TokenToKVPool
from radixserve.radix_cache.swa_pool import SWAKVPool, split_kv_budget

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.model_runner.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SWAMemory:
    full_tokens: int
    window_tokens: int
    layer_windows: tuple[Optional[int], ...]  # per KV layer: its window, None for a full-attention layer


def layer_windows_of(config: "ModelConfig") -> tuple[Optional[int], ...]:
    """Per KV-pool layer: its sliding window (None: full attention)."""
    return tuple(config.window_of(layer) for layer in range(config.num_kv_layers))


def why_not_hybrid(config: "ModelConfig", args: "RunnerConfig") -> Optional[str]:
    """Why this model keeps every layer's KV in one slot space, or None when the window layers get their own."""
    if not config.sliding_windows:
        return "no layer has a sliding window"
    if args.disable_hybrid_swa_memory:
        return "--disable-hybrid-swa-memory"
    if config.is_hybrid:
        return "the window slot space is not built for hybrid linear-attention models"
    if args.page_size != 1:
        return f"the window slot space is token-granular and the page size is {args.page_size}"
    if args.speculative:
        return "speculative decoding's draft and verify steps do not map window slots"
    return None


def plan_swa_memory(config: "ModelConfig", args: "RunnerConfig", full_layout_tokens: int,
                    layer_shapes: list[tuple[int, int]], kv_dtype: torch.dtype) -> Optional[SWAMemory]:
    """The split of the memory of `full_layout_tokens` tokens under the full layout (module docstring), or None (with
    a log line saying why) when the window layers share the full slot space."""
    reason = why_not_hybrid(config, args)
    if reason is not None:
        if config.sliding_windows:
            logger.info("sliding-window model: every layer keeps every token's KV (%s)", reason)
        return None
    layer_windows = layer_windows_of(config)
    window_layers = [w is not None for w in layer_windows]
    budget = full_layout_tokens * TokenToKVPool.bytes_per_token_of(layer_shapes, kv_dtype)
    full_bytes, window_bytes = SWAKVPool.bytes_per_token_split(layer_shapes, window_layers, kv_dtype)
    full, window = split_kv_budget(budget, full_bytes, window_bytes, args.swa_full_tokens_ratio)
    logger.info("hybrid sliding-window memory: %d full slots (%d full-attention layers), %d window slots (%d window "
                "layers), in the memory of %d tokens of the full layout (--swa-full-tokens-ratio %g)",
                full, window_layers.count(False), window, window_layers.count(True), full_layout_tokens,
                args.swa_full_tokens_ratio)
    return SWAMemory(full, window, layer_windows)
