"""What a scheduler reports about itself: its start-up facts (`ModelInfo`, in its ProcessReady) and its live state
(`ServerInfo`, the GetServerInfoReq reply, built by scheduler/info.py), and one report from several replicas'.
The report's KV-memory and prefix-cache parts are in cache_info.py; the merge helpers every part uses, in
replica_merge.py.

`ServerInfo.to_dict()` is the JSON of `/get_server_info` and `Engine.get_server_info()`: SGLang's flat shape (the
model's facts and the scheduler's counters at the top level), whose keys clients read.

`ServerInfo.merge` makes one report from the data-parallel replicas' (the `--dp-size` schedulers, or the Ray
ingress's replicas). Each field is merged by what it means:
- summed: counters (requests, tokens, batches, cache queries and hits), KV slots (`memory`, the pool sizes), queue
  sizes, and throughput (each replica's is its own tokens per second over the same window);
- recomputed from the summed parts: hit rates (matched / queried), token usage ((total - free - evictable) /
  total), the speculative acceptance rate and length; the admission estimate `new_token_ratio` is averaged;
- kept once: the configuration every replica shares (model, context length, TP layout, write policy, a tenant's
  weight). A replica that disagrees (one from an older deployment, during a rolling update) is logged and the
  lowest rank's value kept;
- per replica: each one's load under `replicas`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import msgspec

from radixserve.runtime.wire.cache_info import CacheInfo, MemoryInfo
from radixserve.runtime.wire.replica_merge import _kept_once, _sum, _summed
from radixserve.runtime.wire.sampling_params import RequestLimits


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the scheduler tells the other processes once its model is loaded (in its ProcessReady)."""

    context_len: int
    vocab_size: int
    max_total_num_tokens: int  # KV slots in the pool
    max_running_requests: int
    page_size: int
    eos_token_ids: list[int]
    model_path: Optional[str]
    device: str
    dtype: str
    attention_backend: str
    chunked_prefill_size: Optional[int]
    schedule_policy: str
    overlap_schedule: bool
    radix_cache: bool
    hierarchical_cache: bool = False
    sampling_backend: str = "pytorch"
    decode_attention_backend: Optional[str] = None  # where decode batches attend, when not on attention_backend
    tokenizer_path: Optional[str] = None  # filled in by the parent, which resolved it
    # Values for unset temperature/top_p/top_k/min_p/repetition_penalty (the model's generation_config.json
    # under --sampling-defaults model; empty under openai).
    sampling_defaults: dict[str, float] = {}
    lora_adapters: dict[str, str] = {}  # LoRA adapters loaded at start-up: name -> path
    lora_enabled: bool = False
    # Data-parallel replicas behind the controller; the fields above (the KV pool included) describe one of them.
    dp_size: int = 1
    # Pooling (runtime/wire/pooling.py): the kinds of pooling request the model serves, how it pools an embedding
    # (None unless it serves embed), its classification labels (id2label order; empty unless it serves classify),
    # and whether it generates text at all.
    pooling_kinds: list[str] = msgspec.field(default_factory=lambda: ["score"])
    pooling_method: Optional[str] = None
    labels: list[str] = []
    is_generation: bool = True
    weight_version: str = "default"  # the weights served now (runtime/wire/weights.py)
    request_limits: RequestLimits = RequestLimits()  # what one request may multiply (--max-request-n, ...)

    def to_dict(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self), "request_limits": msgspec.structs.asdict(self.request_limits)}

    @classmethod
    def merge(cls, parts: Sequence["ModelInfo"]) -> "ModelInfo":
        """The pool sizes summed, `dp_size` the number of replicas, every other fact kept once."""
        summed = ("max_total_num_tokens", "max_running_requests")
        kept = _kept_once(parts, exclude=(*summed, "dp_size"))
        return msgspec.structs.replace(kept, **{name: sum(getattr(p, name) for p in parts) for name in summed},
                                       dp_size=len(parts))


class SchedulerCounters(msgspec.Struct, kw_only=True):
    """The scheduler's cumulative counters (scheduler/stats.py); every field is a count, summed across replicas."""

    num_requests: int
    num_finished: int
    num_aborted: int
    num_retractions: int
    prefill_tokens_computed: int
    decode_steps: int
    extend_batches: int
    mixed_batches: int
    partial_chunks: int
    forced_syncs: int
    generated_tokens: int


class TensorParallelLayout(msgspec.Struct, kw_only=True):
    """The tensor-parallel layout: ranks, heads per rank, whether KV heads are replicated across ranks, and how many
    of the ranks shard a mixture of experts' experts."""

    tp_size: int
    num_attention_heads: int
    num_key_value_heads: int
    attention_heads_per_rank: int
    kv_heads_per_rank: int
    kv_heads_replicated: bool
    backend: Optional[str]  # "nccl" or "gloo" with tp_size > 1
    ep_size: int = 1  # expert-parallel ranks inside the group: each holds 1/ep_size of the routed experts


class TenantShare(msgspec.Struct, kw_only=True):
    weight: float  # the tenant's fair-share weight (kept once)
    tokens_computed: int
    live_requests: int  # queued or running


class FairShareInfo(msgspec.Struct, kw_only=True):
    enabled: bool
    tenants: dict[str, TenantShare]  # "default" for requests without a tenant

    @classmethod
    def merge(cls, parts: Sequence["FairShareInfo"]) -> "FairShareInfo":
        names = sorted({name for p in parts for name in p.tenants})
        tenants = {}
        for name in names:
            shares = [p.tenants[name] for p in parts if name in p.tenants]
            tenants[name] = TenantShare(weight=_kept_once([s.weight for s in shares], f"tenant {name}'s weight"),
                                        tokens_computed=_sum(shares, "tokens_computed"),
                                        live_requests=_sum(shares, "live_requests"))
        return cls(enabled=_kept_once([p.enabled for p in parts], "fair_share.enabled"), tenants=tenants)


class SpecInfo(msgspec.Struct, kw_only=True):
    """Speculative decoding's counters; the rate and the mean length derive from them."""

    verify_steps: int
    num_proposed_drafts: int
    num_accepted_drafts: int
    num_verified_entries: int  # (request, verify step) pairs

    @property
    def accept_rate(self) -> float:
        return self.num_accepted_drafts / self.num_proposed_drafts if self.num_proposed_drafts else 0.0

    @property
    def avg_accept_length(self) -> float:
        """Tokens a request gained per verify step (the accepted drafts and the verifier's own token)."""
        return 1 + self.num_accepted_drafts / self.num_verified_entries if self.num_verified_entries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"spec_verify_steps": self.verify_steps, "spec_num_proposed_drafts": self.num_proposed_drafts,
                "spec_num_accepted_drafts": self.num_accepted_drafts, "spec_accept_rate": self.accept_rate,
                "avg_spec_accept_length": self.avg_accept_length}


class ReplicaView(msgspec.Struct, kw_only=True):
    """One replica's load, as a merged report lists it under `replicas`."""

    dp_rank: int
    num_running_reqs: int
    num_queued_reqs: int
    token_usage: float
    gen_throughput: float
    memory: MemoryInfo
    cache_hit_rate: float
    matched_tokens: int
    queried_tokens: int
    avg_spec_accept_length: Optional[float] = None  # with speculative decoding
    replica_id: Optional[str] = None  # the Ray Serve replica's id, behind the Ray ingress

    def to_dict(self) -> dict[str, Any]:
        out = {**msgspec.structs.asdict(self), "memory": self.memory.to_dict()}
        return {key: value for key, value in out.items()
                if value is not None or key not in ("avg_spec_accept_length", "replica_id")}


class RetentionInfo(msgspec.Struct, kw_only=True):
    """Retained sessions (radix_cache/retention.py): what is kept from eviction now, per tenant ("" for none), the
    quotas, and since start the sessions released at expiry, refused (longer than the quota alone) and displaced
    (released early for another within a quota)."""

    sessions: int
    retained_tokens: int
    tokens_by_tenant: dict[str, int]
    tenant_quota_tokens: int
    total_quota_tokens: int
    expired_sessions: int
    refused_sessions: int
    displaced_sessions: int
    next_expiry_in: Optional[float]  # seconds until the soonest expiry; None with no session

    @classmethod
    def merge(cls, parts: Sequence["RetentionInfo"]) -> Optional["RetentionInfo"]:
        """Replicas' sessions and tokens summed (a session lives on the replica that served it), quotas per replica."""
        if not parts:
            return None
        by_tenant: dict[str, int] = {}
        for part in parts:
            for tenant, tokens in part.tokens_by_tenant.items():
                by_tenant[tenant] = by_tenant.get(tenant, 0) + tokens
        expiries = [p.next_expiry_in for p in parts if p.next_expiry_in is not None]
        return cls(sessions=_sum(parts, "sessions"), retained_tokens=_sum(parts, "retained_tokens"),
                   tokens_by_tenant=by_tenant, tenant_quota_tokens=parts[0].tenant_quota_tokens,
                   total_quota_tokens=parts[0].total_quota_tokens, expired_sessions=_sum(parts, "expired_sessions"),
                   refused_sessions=_sum(parts, "refused_sessions"),
                   displaced_sessions=_sum(parts, "displaced_sessions"),
                   next_expiry_in=min(expiries) if expiries else None)


class ServerInfo(msgspec.Struct, kw_only=True):
    """One scheduler's report (`dp_rank` set), or the merge of several (`replicas` set); see the module docstring."""

    model: ModelInfo
    counters: SchedulerCounters
    gen_throughput: float  # generated tokens per second, over the last few seconds
    memory: MemoryInfo
    cache: CacheInfo
    num_running_reqs: int
    num_queued_reqs: int  # waiting, chunked, or compiling a grammar
    new_token_ratio: float  # the admission's estimate of the new tokens running requests still need
    tensor_parallel: TensorParallelLayout
    fair_share: FairShareInfo
    cascade_batches: int  # batches whose attention read a prefix shared by several requests once
    speculative: Optional[SpecInfo] = None
    dp_rank: Optional[int] = 0
    replicas: Optional[list[ReplicaView]] = None
    num_pending_requests_in_tokenizer_manager: Optional[int] = None  # filled in by the TokenizerManager
    retention: Optional[RetentionInfo] = None  # one scheduler's retained sessions

    @property
    def token_usage(self) -> float:
        return self.memory.token_usage

    def replica_view(self) -> ReplicaView:
        return ReplicaView(
            dp_rank=self.dp_rank or 0, num_running_reqs=self.num_running_reqs, num_queued_reqs=self.num_queued_reqs,
            token_usage=self.token_usage, gen_throughput=self.gen_throughput, memory=self.memory,
            cache_hit_rate=self.cache.hit_rate, matched_tokens=self.cache.matched_tokens,
            queried_tokens=self.cache.queried_tokens,
            avg_spec_accept_length=None if self.speculative is None else self.speculative.avg_accept_length)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.model.to_dict(),
            **msgspec.structs.asdict(self.counters),
            "gen_throughput": self.gen_throughput,
            "memory": self.memory.to_dict(),
            "cache": self.cache.to_dict(),
            "num_running_reqs": self.num_running_reqs,
            "num_queued_reqs": self.num_queued_reqs,
            "token_usage": self.token_usage,
            "new_token_ratio": self.new_token_ratio,
            "tensor_parallel": msgspec.structs.asdict(self.tensor_parallel),
            "fair_share": {"enabled": self.fair_share.enabled,
                           "tenants": {name: msgspec.structs.asdict(share)
                                       for name, share in self.fair_share.tenants.items()}},
            "cascade_batches": self.cascade_batches,
        }
        if self.speculative is not None:
            out.update(self.speculative.to_dict())
        if self.dp_rank is not None:
            out["dp_rank"] = self.dp_rank
        if self.replicas is not None:
            out["replicas"] = [view.to_dict() for view in self.replicas]
        if self.num_pending_requests_in_tokenizer_manager is not None:
            out["num_pending_requests_in_tokenizer_manager"] = self.num_pending_requests_in_tokenizer_manager
        if self.retention is not None:
            out["retention"] = msgspec.structs.asdict(self.retention)
        return out

    @classmethod
    def merge(cls, parts: Sequence["ServerInfo"]) -> "ServerInfo":
        """One report from the replicas' (in `dp_rank` order); see the module docstring for each field's rule."""
        parts = sorted(parts, key=lambda info: info.dp_rank or 0)
        specs = [p.speculative for p in parts if p.speculative is not None]
        pending = [p.num_pending_requests_in_tokenizer_manager for p in parts]
        return cls(
            model=ModelInfo.merge([p.model for p in parts]),
            counters=_summed(SchedulerCounters, [p.counters for p in parts]),
            gen_throughput=_sum(parts, "gen_throughput"),
            memory=MemoryInfo.merge([p.memory for p in parts]),
            cache=CacheInfo.merge([p.cache for p in parts]),
            num_running_reqs=_sum(parts, "num_running_reqs"),
            num_queued_reqs=_sum(parts, "num_queued_reqs"),
            new_token_ratio=_sum(parts, "new_token_ratio") / len(parts),
            tensor_parallel=_kept_once([p.tensor_parallel for p in parts], "tensor_parallel"),
            fair_share=FairShareInfo.merge([p.fair_share for p in parts]),
            cascade_batches=_sum(parts, "cascade_batches"),
            speculative=_summed(SpecInfo, specs) if specs else None,
            dp_rank=None,
            replicas=[p.replica_view() for p in parts],
            num_pending_requests_in_tokenizer_manager=None if None in pending else sum(pending),
            retention=RetentionInfo.merge([p.retention for p in parts if p.retention is not None]),
        )
