"""What the scheduler reports about itself: at start-up (`ready_info`, sent in ProcessReady) and on request
(`server_info`, the GetServerInfoReq reply, which includes the start-up facts).

`memory` counts KV token slots: `free + evictable + protected + held by running requests == total`, so an idle
scheduler has `free + evictable == total`. `cache.hit_rate` is the share of prompt tokens served from the radix
cache at each request's first admission; `cache.tree` holds the tree's own counters (every match query) and
`cache.namespaces` the same per namespace (the 1,024 most recently used; radix_cache/stats.py), keyed by
`namespace_name` (a client's `cache_salt` appears only as a digest, so nobody who reads the statistics can reuse
another client's salt).
With the hierarchical cache, `memory` adds the host tier (`host_total_tokens == host_free_tokens +
host_used_tokens`) and the disk tier, and `cache.hicache` its moves between tiers (radix_cache/stats.py).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Protocol

from radixserve.runtime.wire.cache_tree import namespace_name
from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.server_args import ServerArgs


class SchedulerState(Protocol):
    """What the reports read of a scheduler (scheduler/scheduler.py holds the one implementation)."""

    args: ServerArgs
    runner: Any  # the ModelRunner
    allocator: Any
    cache: Any  # the PrefixCache
    stats: Any  # SchedulerStats
    max_running: int
    page_size: int
    chunk_size: Optional[int]
    overlap: bool
    grammars: Any
    new_token_ratio: Any
    fair_share: Any
    speculator: Any

    @property
    def running(self) -> list: ...

    @property
    def waiting(self) -> list: ...

    @property
    def chunked_req(self) -> Any: ...


def ready_info(scheduler: SchedulerState) -> ModelInfo:
    runner, args = scheduler.runner, scheduler.args
    return ModelInfo(
        max_total_num_tokens=scheduler.allocator.size,
        max_running_requests=scheduler.max_running,
        context_len=runner.context_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=list(runner.model_config.eos_token_ids),
        page_size=scheduler.page_size,
        model_path=args.model_path or getattr(runner, "model_dir", None),
        device=str(runner.device),
        dtype=str(runner.dtype).replace("torch.", ""),
        attention_backend=args.resolved_attention_backend(),
        chunked_prefill_size=scheduler.chunk_size,
        schedule_policy=args.schedule_policy,
        overlap_schedule=scheduler.overlap,
        radix_cache=not args.disable_radix_cache,
        hierarchical_cache=args.enable_hierarchical_cache,
        sampling_backend=args.sampling_backend or "pytorch",
        sampling_defaults=dict(runner.model_config.sampling_defaults) if args.sampling_defaults == "model" else {},
        lora_enabled=getattr(runner, "lora_manager", None) is not None,
        lora_adapters=runner.lora_manager.loaded() if getattr(runner, "lora_manager", None) is not None else {},
    )


def server_info(scheduler: SchedulerState) -> dict[str, Any]:
    allocator, cache, stats = scheduler.allocator, scheduler.cache, scheduler.stats
    total = allocator.size
    free = allocator.available_size()
    evictable = cache.evictable_size()
    tree_stats = cache.stats()
    namespaces = {namespace_name(ns): counters for ns, counters in tree_stats.pop("namespaces", {}).items()}
    memory = {"total_tokens": total, "free_tokens": free, "evictable_tokens": evictable,
              "protected_tokens": cache.protected_size()}
    cache_info = {"hit_rate": stats.cache_hit_rate, "matched_tokens": stats.cached_tokens,
                  "queried_tokens": stats.queried_tokens, "tree": tree_stats, "namespaces": namespaces}
    tiers = cache.lower_tiers()
    if tiers is not None:
        tier_figures = asdict(tiers)
        cache_info["hicache"] = {"write_policy": tier_figures.pop("write_policy"), **tier_figures.pop("counters")}
        memory.update(tier_figures)
    return {
        **ready_info(scheduler).to_dict(),
        **stats.as_dict(),
        "memory": memory,
        "cache": cache_info,
        "num_running_reqs": len(scheduler.running),
        "num_queued_reqs": len(scheduler.waiting) + (scheduler.chunked_req is not None) + scheduler.grammars.num_queued,
        "token_usage": (total - free - evictable) / total,
        "new_token_ratio": scheduler.new_token_ratio.value,
        "tensor_parallel": tp_layout(scheduler.runner),
        "fair_share": {"enabled": scheduler.fair_share.enabled, "tenants": scheduler.fair_share.summary()},
        # Batches whose attention read a prefix shared by several requests once (cascade attention).
        "cascade_batches": getattr(getattr(scheduler.runner, "attn_backend", None), "num_cascade_batches", 0),
        **scheduler.speculator.info(),
        "dp_rank": getattr(scheduler.runner, "dp_rank", 0),
    }


def tp_layout(runner: Any) -> dict[str, Any]:
    """The tensor-parallel layout: ranks, heads per rank, and whether KV heads are replicated across ranks."""
    config = runner.model_config
    layout = getattr(runner, "head_layout", None)
    tp_size = runner.tp.size if hasattr(runner, "tp") else 1
    heads = layout.num_heads if layout else config.num_attention_heads
    kv_heads = layout.num_kv_heads if layout else config.num_key_value_heads
    return {"tp_size": tp_size, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "attention_heads_per_rank": heads,
            "kv_heads_per_rank": kv_heads, "kv_heads_replicated": tp_size > config.num_key_value_heads,
            "backend": "nccl" if tp_size > 1 and str(runner.device).startswith("cuda") else
                       ("gloo" if tp_size > 1 else None)}

