"""Ray Serve request routers for the EngineReplica deployment (Ray's `RequestRouter` API).

- `AffinityRequestRouter` ("affinity", the default): radixserve's cache-aware policy (data_parallel/policy.py, the
  one `--dp-size` uses): the replica believed to hold the longest prefix of the prompt's token ids in the request's
  namespace, unless the load is imbalanced or no replica holds enough of it. Loads are the requests this router
  sent and that have not completed. Replicas get stable integer indices in the order first seen (never reused), so
  a restarted replica, which Ray gives a new id, starts with an empty picture of its cache.
- `PowerOfTwoRouter` ("pow2"): Ray's default power-of-two-choices procedure, unchanged.

Both send a control request carrying `ReplicaTarget` to exactly that replica, and register themselves as the
ingress's ReplicaDirectory (routing.py). Neither mixes in Ray's FIFOMixin: under FIFO, a replica chosen for one
request may be handed to an older pending one, which would send a prefix or a control request to the wrong
replica; each request gets the replica chosen for it.

Ray creates the router in the process of the handle's caller (the ingress replica) and runs it on its own event
loop thread; the ingress reads the directory from its loop, hence the lock.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from radixserve.runtime.data_parallel.policy import LoadBalancer, LoadEstimate
from radixserve.runtime.ray_serve.routing import PrefixRoute, ReplicaGoneError, ReplicaTarget, register, route_of

Ranked = list[list[RunningReplica]]


class _DirectoryRouter(RequestRouter):
    """What both routers share: the replica directory and targeted control requests."""

    def initialize_state(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no request_router_kwargs {sorted(kwargs)}")
        self._lock = threading.Lock()
        self._ids: dict[str, ReplicaID] = {}  # unique_id -> ReplicaID, in the order first seen
        self._excluded: set[str] = set()  # replicas whose engine is down, until Ray replaces them
        register(self._deployment_id.app_name, self._deployment_id.name, self)

    # ---- ReplicaDirectory ----------------------------------------------------------------------------
    def replica_ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def flushed(self, replica_id: str) -> None:
        """Nothing to forget without a picture of the caches."""

    def exclude(self, replica_id: str) -> None:
        with self._lock:
            if replica_id in self._ids:
                self._excluded.add(replica_id)

    def _usable(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """`replicas` without those excluded, unless that leaves none (a request then waits for Ray's restart)."""
        with self._lock:
            usable = [replica for replica in replicas if replica.replica_id.unique_id not in self._excluded]
        return usable or replicas

    # ---- Ray's hooks ----------------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id.unique_id: replica.replica_id for replica in replicas}
        with self._lock:
            gone = [self._ids[unique] for unique in self._ids if unique not in current]
            self._ids = {unique: rid for unique, rid in self._ids.items() if unique in current}
            self._ids.update((unique, rid) for unique, rid in current.items() if unique not in self._ids)
            self._excluded &= set(current)
        for replica_id in gone:
            self._replica_gone(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._ids.pop(replica_id.unique_id, None)
            self._excluded.discard(replica_id.unique_id)
        self._replica_gone(replica_id)

    def _replica_gone(self, replica_id: ReplicaID) -> None:
        """A replica stopped (died, or was scaled down)."""

    def _targeted(self, pending_request: Optional[PendingRequest]) -> Optional[Ranked]:
        """The one replica a control request is addressed to; fails the request when that replica is gone.
        None when the request is not addressed to a replica."""
        target = route_of(pending_request.kwargs) if pending_request is not None else None
        if not isinstance(target, ReplicaTarget):
            return None
        pending_request.routing_context.should_backoff = True
        with self._lock:
            replica_id = self._ids.get(target.replica_id)
        replica = self.curr_replicas.get(replica_id) if replica_id is not None else None
        if replica is not None:
            return [[replica]]
        if not pending_request.future.done():
            pending_request.future.set_exception(ReplicaGoneError(f"replica {target.replica_id} is gone"))
        return []


class AffinityRequestRouter(_DirectoryRouter):
    """radixserve's cache-aware routing over the replicas; see the module docstring."""

    def initialize_state(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                         balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 22) -> None:
        """Keyword arguments: `request_router_kwargs` of the deployment (the `--dp-*` thresholds' meanings)."""
        super().initialize_state()
        self.balancer = LoadBalancer("cache_aware", 0, cache_threshold, balance_abs_threshold,
                                     balance_rel_threshold, max_tree_tokens)
        self._index: dict[ReplicaID, int] = {}
        self._next_index = itertools.count()
        self._outstanding: collections.Counter[ReplicaID] = collections.Counter()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> Ranked:
        targeted = self._targeted(pending_request)
        if targeted is not None:
            return targeted
        route = route_of(pending_request.kwargs) if pending_request is not None else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no staged locality: back off when all are full
        candidate_replicas = self._usable(candidate_replicas)
        if not isinstance(route, PrefixRoute) or not candidate_replicas:
            return [candidate_replicas]  # not a generation: Ray takes the shortest queue
        # A replica whose queue Ray knows to be full is passed over, so the request spills to the next best.
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        return [[self.choose(available, route)]]

    def choose(self, replicas: list[RunningReplica], route: PrefixRoute) -> RunningReplica:
        """The replica for `route` among `replicas`, recorded as now holding its prefix."""
        with self._lock:
            by_index = {self._index_of(replica.replica_id): replica for replica in replicas}
            loads = {index: LoadEstimate(self._outstanding[replica.replica_id]) for index, replica in by_index.items()}
            best = self.balancer.choose(route.namespace, route.key, loads, list(by_index))
        return by_index[best]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        with self._lock:
            self._outstanding[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        with self._lock:
            if self._outstanding[replica_id] > 0:
                self._outstanding[replica_id] -= 1

    def flushed(self, replica_id: str) -> None:
        with self._lock:
            full_id = self._ids.get(replica_id)
            if full_id in self._index:
                self.balancer.flushed(self._index[full_id])

    def _replica_gone(self, replica_id: ReplicaID) -> None:
        with self._lock:
            index = self._index.pop(replica_id, None)
            self._outstanding.pop(replica_id, None)
            if index is not None:
                self.balancer.flushed(index)

    def _index_of(self, replica_id: ReplicaID) -> int:
        if replica_id not in self._index:
            self._index[replica_id] = next(self._next_index)
        return self._index[replica_id]


class PowerOfTwoRouter(LocalityMixin, MultiplexMixin, _DirectoryRouter):
    """Ray's power of two choices (its default router), plus targeted control requests."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> Ranked:
        targeted = self._targeted(pending_request)
        if targeted is not None:
            return targeted
        ranked = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        usable = self._usable(list(self.curr_replicas.values()))
        return [[replica for replica in group if replica in usable] for group in ranked]


ROUTERS = {"affinity": AffinityRequestRouter, "pow2": PowerOfTwoRouter}
