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

from radixserve.runtime.wire.cache_info import (
    CacheInfo, HiCacheInfo, LowerTierMemory, MemoryInfo, NamespaceCounters, TreeCounters,
)
from radixserve.runtime.wire.cache_tree import namespace_name
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.server_info import (
    FairShareInfo, ModelInfo, RetentionInfo, SchedulerCounters, ServerInfo, SpecInfo, TenantShare, TensorParallelLayout,
)
from radixserve.scheduler.speculative import NoSpeculation


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
    retention: Any  # radix_cache.retention.RetainedSessions
    post_training: Any  # PostTraining (scheduler/weights.py)

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
        decode_attention_backend=args.resolved_decode_attention_backend() if _hybrid(runner) else None,
        chunked_prefill_size=scheduler.chunk_size,
        schedule_policy=args.schedule_policy,
        overlap_schedule=scheduler.overlap,
        radix_cache=not args.disable_radix_cache and runner.is_causal,
        hierarchical_cache=args.enable_hierarchical_cache,
        sampling_backend=args.sampling_backend or "pytorch",
        sampling_defaults=dict(runner.model_config.sampling_defaults) if args.sampling_defaults == "model" else {},
        lora_enabled=getattr(runner, "lora_manager", None) is not None,
        lora_adapters=runner.lora_manager.loaded() if getattr(runner, "lora_manager", None) is not None else {},
        pooling_kinds=list(runner.pooling.kinds),
        pooling_method=runner.pooling.method,
        labels=list(runner.pooling.labels),
        is_generation=runner.pooling.is_generation,
        weight_version=scheduler.post_training.weight_version,
        request_limits=args.request_limits(),
    )


def _retention_info(retention: Any) -> RetentionInfo:
    stats = retention.stats()
    return RetentionInfo(sessions=stats.retained_sessions, retained_tokens=stats.retained_tokens,
                         tokens_by_tenant=stats.tokens_by_tenant, tenant_quota_tokens=retention.tenant_quota,
                         total_quota_tokens=retention.total_quota, expired_sessions=stats.expired_sessions,
                         refused_sessions=stats.refused_sessions, displaced_sessions=stats.displaced_sessions,
                         next_expiry_in=stats.next_expiry_in)


def server_info(scheduler: SchedulerState) -> ServerInfo:
    allocator, cache, stats = scheduler.allocator, scheduler.cache, scheduler.stats
    tiers = cache.lower_tiers()
    counters = stats.as_dict()
    gen_throughput = counters.pop("gen_throughput")
    return ServerInfo(
        model=ready_info(scheduler),
        counters=SchedulerCounters(**counters),
        gen_throughput=gen_throughput,
        memory=MemoryInfo(total_tokens=allocator.size, free_tokens=allocator.available_size(),
                          evictable_tokens=cache.evictable_size(), protected_tokens=cache.protected_size(),
                          lower_tiers=None if tiers is None else _lower_tier_memory(tiers)),
        cache=_cache_info(cache, stats, tiers),
        retention=_retention_info(scheduler.retention),
        num_running_reqs=len(scheduler.running),
        num_queued_reqs=len(scheduler.waiting) + (scheduler.chunked_req is not None) + scheduler.grammars.num_queued,
        new_token_ratio=scheduler.new_token_ratio.value,
        tensor_parallel=tp_layout(scheduler.runner),
        fair_share=FairShareInfo(enabled=scheduler.fair_share.enabled,
                                 tenants={name: TenantShare(**share)
                                          for name, share in scheduler.fair_share.summary().items()}),
        # Batches whose attention read a prefix shared by several requests once (cascade attention).
        cascade_batches=getattr(getattr(scheduler.runner, "attn_backend", None), "num_cascade_batches", 0),
        speculative=_spec_info(scheduler.speculator),
        dp_rank=getattr(scheduler.runner, "dp_rank", 0),
    )


def _cache_info(cache: Any, stats: Any, tiers: Any) -> CacheInfo:
    tree_stats = cache.stats()
    namespaces = {namespace_name(ns): _counters(NamespaceCounters, counters)
                  for ns, counters in tree_stats.pop("namespaces", {}).items()}
    hicache = None if tiers is None else HiCacheInfo(write_policy=tiers.write_policy, **asdict(tiers.counters))
    return CacheInfo(matched_tokens=stats.cached_tokens, queried_tokens=stats.queried_tokens,
                     tree=_counters(TreeCounters, tree_stats), namespaces=namespaces, hicache=hicache)


def _counters(cls: type, counters: dict[str, Any]) -> Any:
    """The cache's counters (radix_cache/stats.py) as `cls`; their hit rate is derived, not carried."""
    return cls(**{name: value for name, value in counters.items() if name != "hit_rate"})


def _lower_tier_memory(tiers: Any) -> LowerTierMemory:
    """The host and disk tiers' sizes (`hiradix.LowerTierInfo` less its write policy and counters)."""
    figures = asdict(tiers)
    del figures["write_policy"], figures["counters"]
    return LowerTierMemory(**figures)


def _spec_info(speculator: Any) -> Optional[SpecInfo]:
    if isinstance(speculator, NoSpeculation):
        return None
    return SpecInfo(verify_steps=speculator.verify_steps, num_proposed_drafts=speculator.num_proposed,
                    num_accepted_drafts=speculator.num_accepted, num_verified_entries=speculator.num_verified_entries)


def tp_layout(runner: Any) -> TensorParallelLayout:
    """The tensor-parallel layout: ranks, heads per rank, and whether KV heads are replicated across ranks."""
    config = runner.model_config
    layout = getattr(runner, "head_layout", None)
    tp_size = runner.tp.size if hasattr(runner, "tp") else 1
    heads = layout.num_heads if layout else config.num_attention_heads
    kv_heads = layout.num_kv_heads if layout else config.num_key_value_heads
    return TensorParallelLayout(
        tp_size=tp_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, attention_heads_per_rank=heads, kv_heads_per_rank=kv_heads,
        kv_heads_replicated=tp_size > config.num_key_value_heads,
        backend="nccl" if tp_size > 1 and str(runner.device).startswith("cuda") else ("gloo" if tp_size > 1 else None),
        ep_size=runner.tp.ep_size if hasattr(runner, "tp") else 1)


def _hybrid(runner: Any) -> bool:
    """Whether the runner's decode batches attend on a backend of their own (model_runner/attention/hybrid.py)."""
    return getattr(getattr(runner, "attn_backend", None), "decode", None) is not None
