"""Prometheus metrics of the HTTP server (`GET /metrics`).

Names and labels follow SGLang's: every metric is `radixserve:<SGLang's name>` with a `model_name` label (the
served model name), so a dashboard written for SGLang works after renaming the prefix `sglang:` to
`radixserve:`. docs/metrics.md lists them.

Per-request counters and latency histograms are fed by the Engine's `request_observer` hook, called once
per finished request with its meta_info and the arrival times of its output chunks; so they cover every
request the engine serves. Load gauges (running and queued requests, KV token usage, cache hit rate,
throughput) are read from the scheduler's server info at scrape time. Per-tenant series (`radixserve:tenant_*`,
labelled by tenant id) come from runtime/http/tenant_usage.py. Each server has its own registry, so
several servers (or tests) in one process never share counters.
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from radixserve.runtime.http.tenant_usage import TenantUsage, TenantUsageCollector
from radixserve.runtime.wire.server_info import RetentionInfo, ServerInfo

PREFIX = "radixserve:"
LABELS = ("model_name",)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class ServerMetrics:
    def __init__(self, model_name: str, tenant_usage: Optional[TenantUsage] = None) -> None:
        self.registry = CollectorRegistry()
        if tenant_usage is not None:  # the per-tenant series (runtime/http/tenant_usage.py), read at scrape time
            self.registry.register(TenantUsageCollector(tenant_usage, model_name, PREFIX))

        def metric(kind: type, name: str, documentation: str, **kwargs: Any) -> Any:
            # The one label value is bound at once, so every series is exported (at 0) from the first scrape.
            family = kind(PREFIX + name, documentation, LABELS, registry=self.registry, **kwargs)
            return family.labels(model_name=model_name)

        # Counters (prometheus_client adds the `_total` suffix).
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = metric(Counter, "cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = metric(Counter, "num_requests", "Number of requests processed.")
        self.num_aborted_requests = metric(Counter, "num_aborted_requests", "Number of requests aborted.")
        # Latency histograms.
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           buckets=TTFT_BUCKETS)
        self.itl = metric(Histogram, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          buckets=ITL_BUCKETS)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds",
                          "Histogram of end-to-end request latency in seconds.", buckets=E2E_BUCKETS)
        # Load gauges, refreshed at scrape time.
        self.num_running_reqs = metric(Gauge, "num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = metric(Gauge, "num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = metric(Gauge, "num_used_tokens", "The number of used KV token slots.")
        self.max_total_num_tokens = metric(Gauge, "max_total_num_tokens", "Maximum total number of KV tokens.")
        self.token_usage = metric(Gauge, "token_usage", "The token usage (fraction of KV token slots in use).")
        self.cache_hit_rate = metric(Gauge, "cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = metric(Gauge, "gen_throughput", "The generation throughput (token/s).")
        self.spec_accept_length = metric(Gauge, "spec_accept_length",
                                         "The average speculative accept length (tokens per verify step).")
        self.spec_accept_rate = metric(Gauge, "spec_accept_rate", "The share of speculative draft tokens accepted.")
        # radixserve's own: retained sessions (radix_cache/retention.py), per tenant ("" for none) and in all.
        self.retained_sessions = metric(Gauge, "retained_sessions", "Sessions whose prefix is retained.")
        self.retention_expired = metric(Gauge, "retention_expired_sessions",
                                        "Retained sessions released at their expiry since start.")
        self.retention_displaced = metric(Gauge, "retention_displaced_sessions",
                                          "Retained sessions released early to make room within a quota.")
        self.retention_quota = metric(Gauge, "retention_tenant_quota_tokens", "Tokens each tenant may retain.")
        self.retained_tokens = Gauge(PREFIX + "retained_tokens", "Tokens retained by sessions, per tenant.",
                                     (*LABELS, "tenant"), registry=self.registry)
        self._model_name = model_name
        # radixserve's own: what the HTTP layer holds (admission control counts these).
        self.http_inflight = metric(Gauge, "http_inflight_requests", "Engine requests the HTTP server holds.")

    def observe_request(self, meta_info: dict[str, Any], token_times: list[float]) -> None:
        """The Engine's request_observer: called once per finished request (from any thread)."""
        self.prompt_tokens.inc(int(meta_info.get("prompt_tokens") or 0))
        self.generation_tokens.inc(int(meta_info.get("completion_tokens") or 0))
        self.cached_tokens.inc(int(meta_info.get("cached_tokens") or 0))
        self.num_requests.inc()
        finish = meta_info.get("finish_reason") or {}
        if finish.get("type") == "abort":
            self.num_aborted_requests.inc()
        if meta_info.get("ttft") is not None:
            self.ttft.observe(float(meta_info["ttft"]))
        for earlier, later in zip(token_times, token_times[1:]):
            self.itl.observe(max(0.0, later - earlier))
        if meta_info.get("e2e_latency") is not None:
            self.e2e.observe(float(meta_info["e2e_latency"]))

    def render(self, server_info: Optional[ServerInfo], http_inflight: int) -> tuple[bytes, str]:
        """The exposition text, with the load gauges refreshed from `server_info` (skipped when None)."""
        if server_info is not None:
            memory, spec = server_info.memory, server_info.speculative
            self.num_running_reqs.set(float(server_info.num_running_reqs))
            self.num_queue_reqs.set(float(server_info.num_queued_reqs))
            self.num_used_tokens.set(float(max(0, memory.total_tokens - memory.free_tokens - memory.evictable_tokens)))
            self.max_total_num_tokens.set(float(server_info.model.max_total_num_tokens))
            self.token_usage.set(server_info.token_usage)
            self.cache_hit_rate.set(server_info.cache.hit_rate)
            self.gen_throughput.set(float(server_info.gen_throughput))
            self.spec_accept_length.set(0.0 if spec is None else spec.avg_accept_length)
            self.spec_accept_rate.set(0.0 if spec is None else spec.accept_rate)
            if server_info.retention is not None:
                self._render_retention(server_info.retention)
        self.http_inflight.set(http_inflight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _render_retention(self, retention: RetentionInfo) -> None:
        self.retained_sessions.set(retention.sessions)
        self.retention_expired.set(retention.expired_sessions)
        self.retention_displaced.set(retention.displaced_sessions)
        self.retention_quota.set(retention.tenant_quota_tokens)
        self.retained_tokens.clear()  # a tenant whose sessions all expired drops out
        for tenant, tokens in retention.tokens_by_tenant.items():
            self.retained_tokens.labels(model_name=self._model_name, tenant=tenant).set(tokens)
