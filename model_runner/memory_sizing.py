"""How many KV token slots and running requests a runner's device holds, decided once at start-up with the weights
loaded.

On a GPU the KV pool takes what the profiled steps leave (the plan of model_runner/memory_plan.py) unless
`--mem-fraction-static` or `--max-total-tokens` sets it; on the CPU it takes a capped share of the available RAM. A
hybrid model's state pool (model_runner/state_memory.py) comes out of the same budget, and every tensor-parallel
rank keeps the pool the smallest rank can hold. `size_memory` is given the ModelRunner under construction (its
model loaded, its pools not yet made) and records on it what the runner keeps of the decision: `state_slots`, and
on a GPU `memory_plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from radixserve.model_runner.memory_plan import GiB, MemoryPlan, graph_bytes, margin_bytes, profile_step_memory
from radixserve.model_runner.parallel import min_over_ranks
from radixserve.model_runner.state_memory import plan_state_pool
from radixserve.radix_cache.pool import TokenToKVPool

logger = logging.getLogger(__name__)

# CPU KV pool: this share of the currently available RAM, at most CPU_KV_MAX_BYTES and 64 full contexts.
CPU_KV_RAM_FRACTION = 0.25
CPU_KV_MAX_BYTES = 1 * GiB
CPU_KV_MAX_CONTEXTS = 64
# The share of the device for weights + KV when the start-up profile fails (held on an H100 80GB with Llama-3.1-8B).
FALLBACK_MEM_FRACTION = 0.80
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 128
# Request rows beyond max_running_requests, so rows for the next batch can be taken while the current
# batch still holds its own (overlap scheduling).
SPARE_REQUEST_ROWS = 8


def default_max_running(kv_tokens: int) -> int:
    """The request limit on a GPU when none is given: a row per 512 KV tokens, between 32 and 1024."""
    return min(1024, max(32, kv_tokens // 512))


def size_memory(runner: Any) -> tuple[int, int]:
    """(usable KV token slots rounded down to whole pages, max running requests); logs the memory plan."""
    args, config = runner.config, runner.model_config
    bytes_per_token = TokenToKVPool.bytes_per_token(
        config.num_kv_layers, runner.head_layout.num_kv_heads, config.head_dim, runner.kv_cache_dtype
    )
    if config.layer_kv_shapes:  # per-layer shapes are served on one rank (models/gemma4.py)
        bytes_per_token = TokenToKVPool.bytes_per_token_of(config.layer_kv_shapes, runner.kv_cache_dtype)
    row_bytes = runner.context_len * 4  # one int32 req_to_token row
    plan: Optional[MemoryPlan] = None
    if args.max_total_tokens is not None:
        budget_tokens = args.max_total_tokens
    elif runner.device.type == "cuda" and args.mem_fraction_static is None:
        try:
            plan = _profiled_plan(runner, bytes_per_token, row_bytes)
            budget_tokens = plan.kv_tokens
        except Exception:  # a start-up that cannot profile still serves, on the fixed share
            logger.exception("profiling the step memory failed; the KV pool takes --mem-fraction-static %.2f",
                             FALLBACK_MEM_FRACTION)
            _reset_after_profile(runner)
            budget_tokens = _kv_budget_bytes(runner, bytes_per_token, FALLBACK_MEM_FRACTION) // bytes_per_token
    else:
        budget_tokens = _kv_budget_bytes(runner, bytes_per_token) // bytes_per_token

    if args.max_running_requests is not None:
        max_running = args.max_running_requests
    elif runner.device.type == "cpu":
        max_running = CPU_DEFAULT_MAX_RUNNING_REQUESTS
    elif plan is not None:
        max_running = min(runner._profiled_max_running, default_max_running(budget_tokens))
    else:
        max_running = default_max_running(budget_tokens)
    if args.max_total_tokens is None and plan is None and runner.device.type == "cuda":
        # The request table lives in the same memory as the KV pool.
        rows_bytes = (max_running + SPARE_REQUEST_ROWS) * row_bytes
        budget_tokens -= -(-rows_bytes // bytes_per_token)

    runner.state_slots, state_bytes = 0, 0
    if config.is_hybrid:  # the state pool comes out of the same budget as the KV pool
        # --max-total-tokens sizes the KV pool alone; a budget from memory is shared with the states.
        from_memory = args.max_total_tokens is None
        max_running, runner.state_slots, state_bytes = plan_state_pool(
            config, max_running, SPARE_REQUEST_ROWS, args, runner.dtype,
            budget_tokens * bytes_per_token if from_memory else None)
        if from_memory:
            budget_tokens -= -(-state_bytes // bytes_per_token)
        logger.info("state pool: %d slots (%d request rows, %d snapshots), %.1f MiB", runner.state_slots,
                    max_running + SPARE_REQUEST_ROWS, runner.state_slots - max_running - SPARE_REQUEST_ROWS,
                    state_bytes / (1 << 20))

    # Every rank schedules the same batches, so every rank's pool must hold what the smallest one holds.
    budget_tokens = min_over_ranks(budget_tokens, runner.tp_cpu_group)
    total = budget_tokens // runner.page_size * runner.page_size
    if total < runner.page_size:
        raise RuntimeError(
            f"not enough memory for the KV cache ({budget_tokens} tokens); lower the model size, raise "
            "mem_fraction_static or set max_total_tokens"
        )
    if runner.device.type == "cuda":
        if plan is None:
            source = ("max_total_tokens" if args.max_total_tokens is not None
                      else f"mem_fraction_static={args.mem_fraction_static or FALLBACK_MEM_FRACTION}")
            plan = MemoryPlan(torch.cuda.get_device_name(runner.device),
                              torch.cuda.get_device_properties(runner.device).total_memory,
                              torch.cuda.memory_allocated(runner.device), total * bytes_per_token, total,
                              source=source)
        else:
            plan = dataclasses.replace(plan, kv=total * bytes_per_token, kv_tokens=total)
        plan = dataclasses.replace(plan, state_pool=state_bytes)
        runner.memory_plan = plan
        logger.info("%s", plan.describe())
    return total, max_running


def _profiled_plan(runner: Any, bytes_per_token: int, row_bytes: int) -> MemoryPlan:
    """The KV pool from what the profiled steps leave (model_runner/memory_plan.py); sets
    `_profiled_max_running`, the request limit the steps were profiled with."""
    args = runner.config
    torch.cuda.synchronize(runner.device)
    free, total = torch.cuda.mem_get_info(runner.device)
    weights = torch.cuda.memory_allocated(runner.device)
    # The request limit follows the pool's size; profile with the largest the pool could give.
    provisional = (free - margin_bytes(total)) // bytes_per_token
    max_running = args.max_running_requests or default_max_running(provisional)
    if runner.model_config.is_hybrid:  # the request limit the recurrent states leave room for
        max_running = plan_state_pool(runner.model_config, max_running, SPARE_REQUEST_ROWS, args, runner.dtype,
                                      free - margin_bytes(total))[0]
    runner._profiled_max_running = max_running
    step = profile_step_memory(runner, max_running, runner._create_attention_backend)
    graph_bs = 0
    if not args.disable_cuda_graph and not args.enable_lora:
        from radixserve.model_runner.cuda_graph import choose_graph_max_batch_size

        graph_bs = choose_graph_max_batch_size(args.cuda_graph_max_bs, total, max_running)
    torch.cuda.synchronize(runner.device)
    free = torch.cuda.mem_get_info(runner.device)[0]
    plan = MemoryPlan(
        device_name=torch.cuda.get_device_name(runner.device), total=total, weights=weights, kv=0, kv_tokens=0,
        activations=max(step.prefill, step.decode), workspace=step.workspace,
        cuda_graphs=graph_bytes(runner, graph_bs, step),
        request_table=(max_running + SPARE_REQUEST_ROWS) * row_bytes, margin=margin_bytes(total))
    kv_bytes = max(0, free - plan.reserve)
    return dataclasses.replace(plan, kv=kv_bytes, kv_tokens=kv_bytes // bytes_per_token)


def _reset_after_profile(runner: Any) -> None:
    for name in ("attn_backend", "req_to_token_pool", "allocator", "token_to_kv_pool"):
        runner.__dict__.pop(name, None)
    runner.model.set_attention_backend(None)
    torch.cuda.empty_cache()


def _kv_budget_bytes(runner: Any, bytes_per_token: int, fraction: Optional[float] = None) -> int:
    """Bytes the KV pool may take: on CUDA what `--mem-fraction-static` leaves after the loaded weights (the
    default is the profiled plan instead, see `_profiled_plan`); on CPU a share of the available RAM, capped
    (a CPU serves few tokens per second, so a bigger pool only costs memory)."""
    fraction = runner.config.mem_fraction_static if fraction is None else fraction
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        free, total = torch.cuda.mem_get_info(runner.device)
        # mem_fraction_static is the share of the whole device for weights + KV; weights are loaded.
        return int(free - total * (1.0 - fraction))
    import psutil

    fraction = fraction if fraction is not None else CPU_KV_RAM_FRACTION
    return int(min(psutil.virtual_memory().available * fraction, CPU_KV_MAX_BYTES,
                   CPU_KV_MAX_CONTEXTS * runner.context_len * bytes_per_token))
