"""What the HTTP routes share: the engine, the configuration, and the table of in-flight requests.

`InflightRequests` is the server's admission control and its map of who owns what. Each HTTP generation
request registers a handle (the id the client sees: a response id or a native rid) with the engine request
ids it created. Admission is refused with 503 + Retry-After once the number of engine requests in flight
would exceed the capacity (`max_running_requests + max_queued_requests`, 1024 queued by default), or while
the server drains for shutdown; one request may hold at most `--max-sequences-per-request` (prompts x n). Handles are per tenant (two tenants may both use rid "x", and
neither learns of the other's), so `/abort_request` acts only on the caller's own tenant's requests; shutdown
aborts everything still running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.requests import Request

from radixserve.runtime.http.errors import APIError
from radixserve.runtime.serving_engine import ServingEngine
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.tenancy import AuthenticationError, Caller, TenantResolver
from radixserve.runtime.http.tenant_usage import TenantUsage
from radixserve.runtime.wire.messages import ModelInfo

RETRY_AFTER_SECONDS = 1


@dataclass
class _Entry:
    tenant: Optional[str]
    engine_rids: list[str]


class InflightRequests:
    def __init__(self, capacity: Optional[int], max_per_request: Optional[int] = None) -> None:
        self.capacity = capacity
        self.max_per_request = max_per_request
        self.draining = False
        self._entries: dict[tuple[Optional[str], str], _Entry] = {}  # (tenant, handle) -> entry
        self._num_engine_requests = 0

    @property
    def num_engine_requests(self) -> int:
        return self._num_engine_requests

    def admit(self, handles: dict[str, list[str]], tenant: Optional[str]) -> None:
        """Register handles (each with its engine rids) or raise: 503 when full or draining, 400 for a
        duplicate id (within the tenant) or a request larger than one request may be."""
        if self.draining:
            raise APIError("The server is shutting down.", status_code=503, code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if len(set(handles)) != len(handles) or any((tenant, h) in self._entries for h in handles):
            raise APIError("a request with this id is already running", status_code=400, param="rid")
        needed = sum(len(rids) for rids in handles.values())
        if self.max_per_request is not None and needed > self.max_per_request:
            raise APIError(
                f"this request needs {needed} sequences (prompts x n); one request may run at most "
                f"{self.max_per_request} (--max-sequences-per-request)", status_code=400, param="n")
        if self.capacity is not None:
            if needed > self.capacity:
                raise APIError(
                    f"this request needs {needed} sequences; the server runs at most {self.capacity} "
                    "at once (lower n or the number of prompts)", status_code=400, param="n")
            if self._num_engine_requests + needed > self.capacity:
                raise APIError("The server's request queue is full; retry later.", status_code=503,
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        for handle, rids in handles.items():
            self._entries[(tenant, handle)] = _Entry(tenant, list(rids))
        self._num_engine_requests += needed

    def release(self, handles: list[str], tenant: Optional[str]) -> None:
        for handle in handles:
            entry = self._entries.pop((tenant, handle), None)
            if entry is not None:
                self._num_engine_requests -= len(entry.engine_rids)

    def engine_rids_owned(self, handle: str, tenant: Optional[str]) -> Optional[list[str]]:
        """The rids behind `tenant`'s `handle` if it is in flight, else None."""
        entry = self._entries.get((tenant, handle))
        return None if entry is None else list(entry.engine_rids)

    def all_engine_rids(self) -> list[tuple[Optional[str], str]]:
        """(tenant, rid) of every engine request in flight."""
        return [(entry.tenant, rid) for entry in self._entries.values() for rid in entry.engine_rids]

    def num_engine_requests_of(self, tenant: Optional[str]) -> int:
        return sum(len(entry.engine_rids) for entry in self._entries.values() if entry.tenant == tenant)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class ServerState:
    """Everything a route needs, built once by `create_app`."""

    engine: ServingEngine
    server_args: ServerArgs
    tenants: TenantResolver
    inflight: InflightRequests
    tokenizer: Any
    served_model_name: str
    model_info: ModelInfo
    context_len: int
    vocab_size: int
    max_total_tokens: Optional[int]
    token_texts: Any = None  # radixserve.runtime.http.openai.logprobs.TokenTexts of the tokenizer
    metrics: Any = None  # radixserve.runtime.http.metrics.ServerMetrics, when enabled
    tenant_usage: Optional[TenantUsage] = None  # per-tenant totals (runtime/http/tenant_usage.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def observe_request(self, meta_info: dict[str, Any], token_times: list[float]) -> None:
        """The Engine's request observer: the tenant's usage, and the metrics when enabled."""
        if self.tenant_usage is not None:
            self.tenant_usage.observe_request(meta_info, meta_info.get("tenant"))
        if self.metrics is not None:
            self.metrics.observe_request(meta_info, token_times)


def caller_tenant(request: Request) -> Optional[str]:
    """FastAPI dependency of the protected routes: the caller's tenant id, or a 401."""
    state: ServerState = request.app.state.server
    try:
        return state.tenants.tenant_for(request.headers.get("authorization"))
    except AuthenticationError as error:
        raise APIError(str(error), status_code=401, code=error.code) from None


def caller(request: Request) -> Caller:
    """FastAPI dependency: the caller (tenant and whether it may administer), or a 401."""
    state: ServerState = request.app.state.server
    try:
        return state.tenants.caller(request.headers.get("authorization"))
    except AuthenticationError as error:
        raise APIError(str(error), status_code=401, code=error.code) from None


def require_admin(who: Caller, what: str) -> None:
    """A 403 unless the caller may administer the server (see runtime/tenancy.py)."""
    if not who.is_admin:
        raise APIError(f"{what} acts on every tenant: it needs the admin API key (--admin-api-key).",
                       status_code=403, code="admin_required")
