"""The responses a tenant stored (`store: true`), for `GET` / `DELETE /v1/responses/{id}` and `previous_response_id`.

Each tenant has its own table, bounded: past `capacity` responses, the least recently used one is dropped (a
response read or continued counts as used). A tenant never sees another's responses: an id of another tenant is
"not found", as an unknown id is. Held in the server process; a restart forgets them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_CAPACITY = 1024


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as the client received it
    conversation: list[dict[str, Any]]  # the chat messages through this response's output, without instructions


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a response store holds at least one response, got capacity {capacity}")
        self.capacity = capacity
        self._by_tenant: dict[Optional[str], OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: Optional[str], stored: StoredResponse) -> None:
        table = self._by_tenant.setdefault(tenant, OrderedDict())
        table[stored.response["id"]] = stored
        table.move_to_end(stored.response["id"])
        while len(table) > self.capacity:
            table.popitem(last=False)

    def get(self, tenant: Optional[str], response_id: str) -> Optional[StoredResponse]:
        table = self._by_tenant.get(tenant)
        stored = None if table is None else table.get(response_id)
        if stored is not None:
            table.move_to_end(response_id)  # type: ignore[union-attr]
        return stored

    def delete(self, tenant: Optional[str], response_id: str) -> bool:
        table = self._by_tenant.get(tenant)
        return table is not None and table.pop(response_id, None) is not None

    def __len__(self) -> int:
        return sum(len(table) for table in self._by_tenant.values())
