"""Prometheus metrics of the HTTP server (`GET /metrics`).

Per-request counters and latency histograms are fed by the Engine's `request_observer` hook, called once
per finished request with its meta_info and the arrival times of its output chunks; so they cover every
request the engine serves. Load gauges (running and queued requests, KV token usage, cache hit rate) are
read from the scheduler's server info at scrape time. Each server has its own registry, so several servers
(or tests) in one process never share counters.
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "radixserve"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_tokens", "Prompt tokens served from the radix cache",
                                     registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between output chunks",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.num_running = Gauge(f"{PREFIX}_num_running_reqs", "Requests in the running batch", registry=r)
        self.num_queued = Gauge(f"{PREFIX}_num_queued_reqs", "Requests waiting in the scheduler", registry=r)
        self.token_usage = Gauge(f"{PREFIX}_token_usage", "Fraction of KV token slots in use", registry=r)
        self.cache_hit_rate = Gauge(f"{PREFIX}_cache_hit_rate", "Prompt tokens matched in the radix cache / queried",
                                    registry=r)
        self.http_inflight = Gauge(f"{PREFIX}_http_inflight_requests", "Engine requests the HTTP server holds",
                                   registry=r)

    def observe_request(self, meta_info: dict[str, Any], token_times: list[float]) -> None:
        """The Engine's request_observer: called once per finished request (from any thread)."""
        self.prompt_tokens.inc(int(meta_info.get("prompt_tokens") or 0))
        self.generation_tokens.inc(int(meta_info.get("completion_tokens") or 0))
        self.cached_tokens.inc(int(meta_info.get("cached_tokens") or 0))
        finish = meta_info.get("finish_reason") or {}
        self.requests.labels(finish_reason=str(finish.get("type", "unknown"))).inc()
        if meta_info.get("ttft") is not None:
            self.ttft.observe(float(meta_info["ttft"]))
        for earlier, later in zip(token_times, token_times[1:]):
            self.itl.observe(max(0.0, later - earlier))
        if meta_info.get("e2e_latency") is not None:
            self.e2e.observe(float(meta_info["e2e_latency"]))

    def render(self, server_info: Optional[dict[str, Any]], http_inflight: int) -> tuple[bytes, str]:
        """The exposition text, with the load gauges refreshed from `server_info` (skipped when None)."""
        if server_info is not None:
            self.num_running.set(float(server_info.get("num_running_reqs") or 0))
            self.num_queued.set(float(server_info.get("num_queued_reqs") or 0))
            self.token_usage.set(float(server_info.get("token_usage") or 0.0))
            self.cache_hit_rate.set(float((server_info.get("cache") or {}).get("hit_rate") or 0.0))
        self.http_inflight.set(http_inflight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
