"""Sizing and building a hybrid model's state pool (radix_cache/state_pool.py) from the memory budget.

The pool has a working slot per request row and snapshot slots for the prefix cache. `--max-mamba-cache-size`
(SGLang's flag) sets the total number of slots; by default there are two snapshot slots per request row, and the
whole pool takes at most `MAX_STATE_SHARE` of the memory budget that the KV pool would otherwise take: where that
cannot hold three slots per row and no request limit was given, the request limit is lowered to fit. The state pool's
bytes are taken from the KV budget.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from radixserve.radix_cache.state_pool import STATE_DTYPES, StatePool

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.model_runner.runner_config import RunnerConfig

logger = logging.getLogger(__name__)

MAX_STATE_SHARE = 0.5
DEFAULT_SNAPSHOTS_PER_ROW = 2


def bytes_per_slot(config: "ModelConfig", ssm_dtype: torch.dtype, conv_dtype: torch.dtype) -> int:
    linear = config.linear_attention
    return StatePool.bytes_per_slot(len(linear.linear_layers), linear.conv_dim, linear.conv_kernel_size,
                                    linear.num_value_heads, linear.key_head_dim, linear.value_head_dim, ssm_dtype,
                                    conv_dtype)


def plan_state_pool(config: "ModelConfig", max_running: int, spare_rows: int, args: "RunnerConfig",
                    conv_dtype: torch.dtype, budget_bytes: Optional[int]) -> tuple[int, int, int]:
    """(max running requests, state slots, state bytes) for a pool beside `max_running + spare_rows` request rows
    within `budget_bytes` (None: no bound, the KV pool was sized on its own); ValueError when the slots asked for
    cannot serve the rows."""
    per_slot = bytes_per_slot(config, STATE_DTYPES[args.mamba_ssm_dtype], conv_dtype)
    if args.max_mamba_cache_size is not None:
        slots = args.max_mamba_cache_size
        if slots <= max_running + spare_rows:
            raise ValueError(f"--max-mamba-cache-size {slots} must exceed the {max_running + spare_rows} request rows "
                             f"(--max-running-requests {max_running} and {spare_rows} spare rows), which each hold a "
                             "running request's state")
        return max_running, slots, slots * per_slot
    per_row = 1 + DEFAULT_SNAPSHOTS_PER_ROW
    affordable = None if budget_bytes is None else int(budget_bytes * MAX_STATE_SHARE) // per_slot
    if (affordable is not None and args.max_running_requests is None
            and (max_running + spare_rows) * per_row > affordable):
        lowered = max(1, affordable // per_row - spare_rows)
        logger.warning("max_running_requests lowered from %d to %d: each request's recurrent state takes %.1f MiB",
                       max_running, lowered, per_slot / (1 << 20))
        max_running = lowered
    slots = (max_running + spare_rows) * per_row
    return max_running, slots, slots * per_slot


def make_state_pool(config: "ModelConfig", num_rows: int, size: int, args: "RunnerConfig", conv_dtype: torch.dtype,
                    device: torch.device) -> StatePool:
    linear = config.linear_attention
    return StatePool(num_rows, size, len(linear.linear_layers), linear.conv_dim, linear.conv_kernel_size,
                     linear.num_value_heads, linear.key_head_dim, linear.value_head_dim,
                     STATE_DTYPES[args.mamba_ssm_dtype], conv_dtype, device)
