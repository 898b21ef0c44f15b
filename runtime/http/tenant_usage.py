"""Per-tenant usage: each tenant's requests, prompt, generated and cached tokens, and queue time.

Fed by the Engine's request observer, once per finished request (its meta_info and tenant id), and read in two
places: `/get_server_info` (a tenant sees its own totals under `tenant_usage`, the administrator every tenant's)
and `/metrics` (`radixserve:tenant_*` series with a `tenant` label, when metrics are enabled).

Label values are bounded and never come from a request: a tenant id of the tenants file (a fixed set read at
start-up), `DEFAULT_LABEL` for requests without a tenant (an open server, a single `--api-key`, the admin key),
and `OTHER_LABEL` for any other id (not expected; it keeps the label set bounded whatever the observer is
given). Nothing of a prompt, a rid or the output text is recorded.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Optional

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

DEFAULT_LABEL = "_default"
OTHER_LABEL = "_other"
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class TenantTotals:
    """One tenant's totals since the server started."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    queue_time_seconds: float = 0.0  # summed over the requests that were admitted
    num_queued: int = 0  # requests with a queue time (an abort before admission has none)
    queue_time_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_TIME_BUCKETS))  # per bucket

    def to_dict(self) -> dict[str, Any]:
        """The tenant view in /get_server_info (no histogram buckets; the mean is easier to read)."""
        out = asdict(self)
        del out["queue_time_buckets"]
        out["mean_queue_time_seconds"] = self.queue_time_seconds / self.num_queued if self.num_queued else 0.0
        return out


class TenantUsage:
    """The totals of every tenant label (see the module docstring); safe to call from any thread."""

    def __init__(self, tenant_ids: Iterable[str]) -> None:
        self._known = frozenset(tenant_ids)
        self._lock = threading.Lock()
        self._totals = {label: TenantTotals() for label in sorted(self._known | {DEFAULT_LABEL})}

    def label_of(self, tenant: Optional[str]) -> str:
        if not tenant:
            return DEFAULT_LABEL
        return tenant if tenant in self._known else OTHER_LABEL

    def observe_request(self, meta_info: dict[str, Any], tenant: Optional[str]) -> None:
        """Add one finished request (its meta_info) to its tenant's totals."""
        queue_time = meta_info.get("queue_time")
        with self._lock:
            totals = self._totals.setdefault(self.label_of(tenant), TenantTotals())
            totals.num_requests += 1
            totals.prompt_tokens += int(meta_info.get("prompt_tokens") or 0)
            totals.generation_tokens += int(meta_info.get("completion_tokens") or 0)
            totals.cached_tokens += int(meta_info.get("cached_tokens") or 0)
            if queue_time is not None:
                totals.num_queued += 1
                totals.queue_time_seconds += float(queue_time)
                first = bisect.bisect_left(QUEUE_TIME_BUCKETS, float(queue_time))
                if first < len(QUEUE_TIME_BUCKETS):
                    totals.queue_time_buckets[first] += 1

    def totals_of(self, tenant: Optional[str]) -> dict[str, dict[str, Any]]:
        """A caller's own totals under its label (the tenant view; the same shape as `all_totals`)."""
        label = self.label_of(tenant)
        with self._lock:
            return {label: self._totals.get(label, TenantTotals()).to_dict()}

    def all_totals(self) -> dict[str, dict[str, Any]]:
        """Every label's totals (the administrator's view)."""
        with self._lock:
            return {label: totals.to_dict() for label, totals in self._totals.items()}

    def snapshot(self) -> dict[str, TenantTotals]:
        with self._lock:
            return {label: TenantTotals(**{**asdict(t), "queue_time_buckets": list(t.queue_time_buckets)})
                    for label, t in self._totals.items()}


class TenantUsageCollector(Collector):
    """Exports a TenantUsage on a Prometheus registry, read at scrape time (SGLang-style names, `radixserve:`)."""

    def __init__(self, usage: TenantUsage, model_name: str, prefix: str) -> None:
        self._usage = usage
        self._model_name = model_name
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        labels = ["model_name", "tenant"]
        counters = {
            "num_requests": ("tenant_num_requests", "Number of requests processed, per tenant."),
            "prompt_tokens": ("tenant_prompt_tokens", "Number of prefill tokens processed, per tenant."),
            "generation_tokens": ("tenant_generation_tokens", "Number of generation tokens processed, per tenant."),
            "cached_tokens": ("tenant_cached_tokens", "Number of cached prompt tokens, per tenant."),
        }
        snapshot = self._usage.snapshot()
        for attribute, (name, documentation) in counters.items():
            family = CounterMetricFamily(self._prefix + name, documentation, labels=labels)
            for label, totals in snapshot.items():
                family.add_metric([self._model_name, label], getattr(totals, attribute))
            yield family
        histogram = HistogramMetricFamily(self._prefix + "tenant_queue_time_seconds",
                                          "Histogram of the time a request waited before its first admission, "
                                          "per tenant.", labels=labels)
        for label, totals in snapshot.items():
            cumulative, buckets = 0, []
            for bound, count in zip(QUEUE_TIME_BUCKETS, totals.queue_time_buckets):
                cumulative += count
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", totals.num_queued))
            histogram.add_metric([self._model_name, label], buckets, totals.queue_time_seconds)
        yield histogram
