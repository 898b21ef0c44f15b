"""What the HTTP routes share: the engine, the configuration, and the table of in-flight requests.

`InflightRequests` is the server's admission control and its map of who owns what. Each HTTP generation
request registers a handle (the id the client sees: a response id or a native rid) with the engine request
ids it created. Admission is refused with 503 + Retry-After once the number of engine requests in flight
would exceed the capacity (`max_running_requests + max_queued_requests`, when `--max-queued-requests` is
set), or while the server drains for shutdown. Ownership lets `/abort_request` act only on the caller's
own tenant's requests, and lets shutdown abort everything still running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.requests import Request

from radixserve.runtime.openai.errors import APIError
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.tenancy import TenantResolver

RETRY_AFTER_SECONDS = 1


@dataclass
class _Entry:
    tenant: Optional[str]
    engine_rids: list[str]


class InflightRequests:
    def __init__(self, capacity: Optional[int]) -> None:
        self.capacity = capacity
        self.draining = False
        self._entries: dict[str, _Entry] = {}
        self._num_engine_requests = 0

    @property
    def num_engine_requests(self) -> int:
        return self._num_engine_requests

    def admit(self, handles: dict[str, list[str]], tenant: Optional[str]) -> None:
        """Register handles (each with its engine rids) or raise: 503 when full or draining, 400 for a
        duplicate id or a request larger than the whole capacity."""
        if self.draining:
            raise APIError("The server is shutting down.", status_code=503, code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if len(set(handles)) != len(handles) or any(h in self._entries for h in handles):
            raise APIError("a request with this id is already running", status_code=400, param="rid")
        needed = sum(len(rids) for rids in handles.values())
        if self.capacity is not None:
            if needed > self.capacity:
                raise APIError(
                    f"this request needs {needed} sequences; the server runs at most {self.capacity} "
                    "at once (lower n or the number of prompts)", status_code=400, param="n")
            if self._num_engine_requests + needed > self.capacity:
                raise APIError("The server's request queue is full; retry later.", status_code=503,
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        for handle, rids in handles.items():
            self._entries[handle] = _Entry(tenant, list(rids))
        self._num_engine_requests += needed

    def release(self, handles: list[str]) -> None:
        for handle in handles:
            entry = self._entries.pop(handle, None)
            if entry is not None:
                self._num_engine_requests -= len(entry.engine_rids)

    def engine_rids_owned(self, handle: str, tenant: Optional[str]) -> Optional[list[str]]:
        """The engine rids behind `handle` if it is in flight and belongs to `tenant`, else None."""
        entry = self._entries.get(handle)
        if entry is None or entry.tenant != tenant:
            return None
        return list(entry.engine_rids)

    def all_engine_rids(self) -> list[str]:
        return [rid for entry in self._entries.values() for rid in entry.engine_rids]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class ServerState:
    """Everything a route needs, built once by `create_app`."""

    engine: Any  # radixserve.runtime.engine.Engine
    server_args: ServerArgs
    tenants: TenantResolver
    inflight: InflightRequests
    tokenizer: Any
    served_model_name: str
    model_info: dict[str, Any]
    context_len: int
    vocab_size: int
    max_total_tokens: Optional[int]
    token_texts: Any = None  # radixserve.runtime.openai.logprobs.TokenTexts of the tokenizer
    metrics: Any = None  # radixserve.runtime.metrics.ServerMetrics, when enabled
    created: int = field(default_factory=lambda: int(time.time()))


def caller_tenant(request: Request) -> Optional[str]:
    """FastAPI dependency of the protected routes: the caller's tenant id, or a 401."""
    state: ServerState = request.app.state.server
    return state.tenants.tenant_for(request.headers.get("authorization"))
