"""What a request to the EngineReplica deployment tells its router, and where the routers can be found.

Every call from the ingress to the replicas carries one keyword argument, `route`:
- `PrefixRoute(namespace, key, tokens)` on a generate call: the cache namespace (tenant, salt) and the prompt's
  token ids, which the affinity router matches against its picture of each replica's cache;
- `ReplicaTarget(replica_id)` on a control call (flush, server info, abort, cache tree) that must reach one given
  replica: both routers send it there, or fail it with ReplicaGoneError when that replica is gone.

The replica methods accept `route` and ignore it. These types are light (no Ray import), so the replica and the
unit tests can use them without a cluster.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from radixserve.runtime.wire.errors import EngineDeadError

ROUTE_KWARG = "route"


@dataclass(frozen=True)
class PrefixRoute:
    namespace: tuple[str, ...]
    key: tuple[int, ...]  # the (first) prompt's token ids
    tokens: int  # what the request adds to its replica's load: prompt + the most it may generate


@dataclass(frozen=True)
class ReplicaTarget:
    replica_id: str  # ReplicaID.unique_id


class ReplicaGoneError(EngineDeadError):
    """The replica a control request was addressed to is no longer running."""


class ReplicaEngineDeadError(EngineDeadError):
    """A replica's engine is down (Ray replaces the replica once its health check fails); raised before the request
    started, so it may be sent to another replica."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"replica {replica_id}: {reason}")
        self.replica_id = replica_id

    def __reduce__(self) -> Any:  # crosses processes: rebuild it from its own arguments
        return (type(self), (self.replica_id, str(self).partition(": ")[2]))


class ReplicaDirectory(Protocol):
    """What the ingress reads from its router, which lives in the ingress's own process (on Ray's router thread)."""

    def replica_ids(self) -> list[str]:
        """The replicas currently routed to (ReplicaID.unique_id), in the order they were first seen."""

    def flushed(self, replica_id: str) -> None:
        """The replica's cache was flushed: it holds nothing any more."""

    def exclude(self, replica_id: str) -> None:
        """The replica's engine is down: route nothing more to it (Ray is about to replace it)."""


_lock = threading.Lock()
_directories: dict[tuple[str, str], ReplicaDirectory] = {}


def register(app_name: str, deployment_name: str, directory: ReplicaDirectory) -> None:
    """Called by a router when Ray creates it for a handle to (app, deployment) in this process."""
    with _lock:
        _directories[(app_name, deployment_name)] = directory


def lookup(app_name: str, deployment_name: str) -> Optional[ReplicaDirectory]:
    with _lock:
        return _directories.get((app_name, deployment_name))


def route_of(kwargs: Any) -> Any:
    """The `route` keyword argument of a pending request, or None."""
    return kwargs.get(ROUTE_KWARG) if isinstance(kwargs, dict) else None
