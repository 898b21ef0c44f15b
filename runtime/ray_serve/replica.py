"""One replica of the EngineReplica deployment: a radixserve Engine (its scheduler and detokenizer processes are
the replica actor's children, so they get the devices Ray gave the actor).

Every method takes the `route` keyword argument its router read (routing.py) and ignores it. Generation streams:
the ingress calls `generate` through `handle.options(stream=True)` and gets the Engine's chunks (or its one final
result) as they come; cancelling that call (the HTTP client left) closes the iteration, which aborts the request
in the engine. `check_health` fails once the engine died, so Ray replaces the replica; until then `generate` refuses
new requests with ReplicaEngineDeadError, which the ingress sends to another replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from ray import serve

from radixserve.runtime.engine import Engine
from radixserve.runtime.ray_serve.routing import ReplicaEngineDeadError
from radixserve.runtime.wire.errors import EngineDeadError
from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest
from radixserve.runtime.wire.server_info import ServerInfo


@dataclass
class ReplicaDescription:
    """What the ingress needs from a replica to serve HTTP: the model's facts and the tokenizer (sent whole, so the
    ingress's node needs no copy of the model files)."""

    model_info: ModelInfo
    tokenizer: Any


class EngineReplica:
    def __init__(self, engine_args: dict[str, Any]) -> None:
        self.engine = Engine(**engine_args)

    async def generate(self, obj: Union[GenerateRequest, NormalizedRequest], route: Any = None) -> AsyncIterator[Any]:
        if not self.engine.is_healthy():  # refused before it starts, so the ingress may retry it elsewhere
            raise ReplicaEngineDeadError(serve.get_replica_context().replica_id.unique_id,
                                         "the engine is not running")
        async for chunk in self.engine.generate_request(obj):
            yield chunk

    def describe(self, route: Any = None) -> ReplicaDescription:
        return ReplicaDescription(self.engine.model_info, self.engine.tokenizer)

    async def server_info(self, route: Any = None) -> ServerInfo:
        return await self.engine.async_server_info()

    async def flush_cache(self, route: Any = None) -> bool:
        return await self.engine.async_flush_cache()

    def abort(self, rid: str, tenant: Optional[str], route: Any = None) -> None:
        self.engine.abort(rid, tenant)

    async def cache_tree(self, fields: dict[str, Any], route: Any = None) -> Any:
        return await self.engine.async_get_cache_tree(**fields)

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine died is restarted."""
        if not self.engine.is_healthy():
            raise EngineDeadError("the replica's engine is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
