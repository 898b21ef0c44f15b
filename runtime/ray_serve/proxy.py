"""The engine the ingress's HTTP app serves: a ServingEngine (runtime/serving_engine.py) whose calls go to the
EngineReplica deployment through its handle.

- Generation: the prompt is tokenized here (the replicas' own tokenizer, sent by `describe`) to route on token
  ids, in the cache namespace `normalize` decided (runtime/wire/request.py); the request goes to the replica the
  router picks, as a Ray streaming call, with its route as a keyword. A batch (several prompts in one request)
  goes to one replica, chosen by its first prompt.
- Tokenization for the OpenAI routes (`async_encode`, `async_encode_chat`) runs here, as the Engine runs it.
- Control requests (flush, server info, cache tree, abort) go to every replica the router knows, one call each,
  addressed with ReplicaTarget; their replies are merged as the `--dp-size` replicas' are
  (tokenizer_manager/replicas.py).
- Post-training calls (weight updates, memory release, pause) are refused (501), for the same reason as adapters.
- LoRA adapters: the replicas serve those they loaded at start-up (`--lora-paths`); loading or unloading one
  through the ingress is refused (501), since a replica Ray starts later would not have it.
- Errors: what a replica raised reaches the HTTP layer as itself (a ValueError stays a 400); a replica that died
  under a request, or a control call that cannot reach a replica in time, is an EngineDeadError (503). A replica
  whose engine is down refuses new requests before they start; they are sent again, and the router passes that
  replica over until Ray replaces it.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, TypeVar, Union

import msgspec
import ray.exceptions
from ray.serve import context as serve_context

from radixserve.runtime.ray_serve.replica import ReplicaDescription
from radixserve.runtime.ray_serve.routing import (
    ROUTE_KWARG, PrefixRoute, ReplicaDirectory, ReplicaEngineDeadError, ReplicaTarget, lookup,
)
from radixserve.runtime.serving_engine import RequestObserver
from radixserve.runtime.wire.cache_tree import CacheTreeSummary
from radixserve.runtime.wire.errors import EngineDeadError
from radixserve.runtime.wire.lora import LoRAAdapterReqOutput
from radixserve.runtime.wire.weights import ControlReqOutput
from radixserve.runtime.wire.messages import UNBOUNDED_NEW_TOKENS
from radixserve.runtime.wire.sampling_params import LengthLimits, SamplingParams
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest, split_prompts
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.tokenizer_manager.replicas import merge_cache_trees
from radixserve.tokenizer_manager.tokenize import TokenizerWorker, load_chat_template

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_SECONDS = 30.0
MAX_ATTEMPTS = 3  # a generation refused by replicas whose engine is down is sent this many times at most
_NOTHING = object()
T = TypeVar("T")


class EngineProxy:
    """The ServingEngine of the ingress's HTTP app; see the module docstring. Lives on the ingress's loop."""

    def __init__(self, handle: Any, description: ReplicaDescription, server_args: ServerArgs,
                 max_replicas: int) -> None:
        """`handle`: the EngineReplica deployment's handle; `max_replicas` sizes the HTTP admission capacity."""
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        info = description.model_info
        # The app runs what all its replicas run: that sizes the HTTP admission capacity. (dp_size stays each
        # replica's own, the range of data_parallel_rank, which a replica's engine applies within itself.)
        self.model_info = msgspec.structs.replace(info, max_running_requests=info.max_running_requests * max_replicas)
        self.tokenizer = description.tokenizer
        self.server_args = server_args
        self.request_observer: Optional[RequestObserver] = None
        self._worker = TokenizerWorker(copy.deepcopy(self.tokenizer), load_chat_template(server_args.chat_template))
        self._limits = LengthLimits(info.context_len, info.max_total_num_tokens, info.page_size)
        self._aborts: set[asyncio.Task] = set()

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters every replica loaded at start-up (`--lora-paths`)."""
        return dict(self.model_info.lora_adapters)

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str,
                                      pinned: bool = False) -> LoRAAdapterReqOutput:
        return self._lora_refused()

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput:
        return self._lora_refused()

    async def async_post_training(self, request_type: type, **fields: Any) -> Any:
        return ControlReqOutput(
            rpc_id="", success=False, status_code=501,
            message="weight updates, memory release and pause are not offered through the Ray ingress (a replica "
                    "started later would serve other weights): drive each replica's Engine")

    def _lora_refused(self) -> LoRAAdapterReqOutput:
        return LoRAAdapterReqOutput(
            "", success=False, loaded_adapters=self.lora_adapters, status_code=501,
            error_message="LoRA adapters cannot be loaded or unloaded through the Ray ingress (a replica started "
                          "later would not have them): give them to every replica with --lora-paths")

    # ---- generation ------------------------------------------------------------------------------
    async def generate_request(self, obj: Union[GenerateRequest, NormalizedRequest]) -> AsyncIterator[Any]:
        route = await self._route(obj)
        stream, first = await self._start(obj, route)
        arrivals: dict[int, list[float]] = {}
        finished = False
        try:
            if first is not _NOTHING:
                self._observe(first, arrivals, obj.tenant)
                yield first
                async for chunk in stream:
                    self._observe(chunk, arrivals, obj.tenant)
                    yield chunk
            finished = True
        except ray.exceptions.RayError as error:
            raise _replica_error(error) from None
        finally:
            if not finished:
                stream.cancel()  # the replica's iteration is closed, which aborts the request in its engine

    async def _start(self, obj: Union[GenerateRequest, NormalizedRequest], route: PrefixRoute) -> tuple[Any, Any]:
        """Send the request and wait for its first chunk; a replica whose engine is down refuses it before it
        starts, and it goes to another one."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = own_request_id(lambda: self._stream_handle.generate.remote(obj, **{ROUTE_KWARG: route}))
            try:
                return stream, await stream.__anext__()
            except StopAsyncIteration:
                return stream, _NOTHING
            except ray.exceptions.RayError as error:
                failure = _replica_error(error)
                if not isinstance(failure, ReplicaEngineDeadError) or attempt == MAX_ATTEMPTS:
                    raise failure from None
                logger.warning("%s: sending the request to another replica", failure)
                directory = self._directory()
                if directory is not None:
                    directory.exclude(failure.replica_id)
            except BaseException:
                stream.cancel()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _observe(self, chunk: Any, arrivals: dict[int, list[float]], tenant: Optional[str]) -> None:
        """Feed finished requests to `request_observer` (the server's metrics), with the times their chunks
        reached the ingress as the token times, and the caller's tenant (as the TokenizerManager's observer has)."""
        if self.request_observer is None:
            return
        now = time.monotonic()
        for position, result in enumerate(chunk if isinstance(chunk, list) else [chunk]):
            index = result.get("index", position)
            arrivals.setdefault(index, []).append(now)
            meta = result.get("meta_info") or {}
            if meta.get("finish_reason") is not None:
                self.request_observer({**meta, "tenant": tenant}, arrivals.pop(index))

    async def _route(self, obj: Union[GenerateRequest, NormalizedRequest]) -> PrefixRoute:
        """The request's cache namespace, as `normalize` decided it, and its (first) prompt's token ids."""
        if isinstance(obj, NormalizedRequest):
            first = obj.prompts[0]
            namespace, ids, max_new = first.options.namespace, first.input_ids, first.sampling_params.max_new_tokens
            text = first.text
        else:  # an in-process caller's request: its replica's engine normalizes it; the namespace is the same
            first = split_prompts(obj)[0]
            namespace, ids, text = first.namespace(obj.tenant), first.input_ids, first.text
            params = first.sampling_params
            max_new = params.max_new_tokens if isinstance(params, SamplingParams) else params.get("max_new_tokens")
        if ids is None:
            ids = await self.async_encode(text)
        tokens = len(ids) + (UNBOUNDED_NEW_TOKENS if max_new is None else int(max_new))
        return PrefixRoute(namespace, tuple(ids), tokens)

    # ---- tokenization ----------------------------------------------------------------------------
    async def async_encode(self, text: str) -> list[int]:
        return await self._worker.encode(text, self._limits.max_sequence_tokens()[0])

    async def async_encode_chat(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        return await self._worker.apply_chat_template(conversation, self._limits.max_sequence_tokens()[0],
                                                      **template_kwargs)

    # ---- control ---------------------------------------------------------------------------------
    async def async_server_info(self) -> ServerInfo:
        """The replicas' reports merged as the `--dp-size` replicas' are, each replica's view naming its Ray id."""
        replies = await self._each_replica(lambda target: self._handle.server_info.remote(**target))
        merged = ServerInfo.merge([msgspec.structs.replace(info, dp_rank=index)
                                   for index, (_, info) in enumerate(replies)])
        merged.replicas = [msgspec.structs.replace(view, replica_id=replica_id)
                           for view, (replica_id, _) in zip(merged.replicas or [], replies)]
        return merged

    async def async_flush_cache(self) -> bool:
        replies = await self._each_replica(lambda target: self._handle.flush_cache.remote(**target))
        directory = self._directory()
        for replica_id, flushed in replies:
            if flushed and directory is not None:
                directory.flushed(replica_id)
        return all(flushed for _, flushed in replies)

    async def async_get_cache_tree(self, **fields: Any) -> CacheTreeSummary:
        replies = await self._each_replica(lambda target: self._handle.cache_tree.remote(fields, **target))
        return merge_cache_trees([summary for _, summary in replies])

    def abort(self, rid: str, tenant: Optional[str] = None) -> None:
        """Abort `rid` wherever it runs (every replica is asked; those without it ignore the abort)."""
        task = asyncio.get_running_loop().create_task(
            self._each_replica(lambda target: self._handle.abort.remote(rid, tenant, **target)))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def is_healthy(self) -> bool:
        """True while the router knows at least one running replica (or has not been asked yet)."""
        directory = self._directory()
        return directory is None or bool(directory.replica_ids())

    # ---- internals -------------------------------------------------------------------------------
    def _directory(self) -> Optional[ReplicaDirectory]:
        return lookup(self._handle.app_name, self._handle.deployment_name)

    async def _each_replica(self, call: Callable[[dict[str, Any]], Any]) -> list[tuple[str, Any]]:
        """`call` on every running replica, (replica id, reply) for those that answered. Raises EngineDeadError
        when none did."""
        directory = self._directory()
        if directory is None or not directory.replica_ids():
            await self._handle.describe.remote()  # the first call creates the router and waits for a replica
            directory = self._directory()
        replica_ids = directory.replica_ids() if directory is not None else []

        async def one(replica_id: str) -> Any:
            response = own_request_id(lambda: call({ROUTE_KWARG: ReplicaTarget(replica_id)}))
            return await asyncio.wait_for(response, CONTROL_TIMEOUT_SECONDS)

        replies = await asyncio.gather(*(one(replica_id) for replica_id in replica_ids), return_exceptions=True)
        answered = []
        for replica_id, reply in zip(replica_ids, replies):
            if isinstance(reply, BaseException):
                logger.warning("replica %s did not answer a control request: %r", replica_id, reply)
                continue
            answered.append((replica_id, reply))
        if not answered:
            raise EngineDeadError("no replica answered")
        return answered


def _replica_error(error: ray.exceptions.RayError) -> BaseException:
    """What a replica raised, as the Engine would have raised it; a replica lost under the request as
    EngineDeadError."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, Exception):
        cause = error.cause
        return _replica_error(cause) if isinstance(cause, ray.exceptions.RayError) else cause
    logger.warning("a replica failed under a request: %s", type(error).__name__)
    return EngineDeadError(f"the replica serving the request failed ({type(error).__name__})")


def own_request_id(call: Callable[[], T]) -> T:
    """Make the handle call `call` makes under an internal request id of its own.

    Ray Serve gives every handle call made while serving one HTTP request that request's internal id, and a router
    without FIFOMixin (ours: see router.py) hands the replica it chose to the pending request with the id it routed.
    Two calls in flight with one id (a control request fanned out to every replica, the prompts of one HTTP
    request) would then leave all but one of them pending forever. The id lives in a context variable that the
    handle reads when called, so the call runs in a copy of the context with a fresh id."""

    def with_fresh_id() -> T:
        current = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
        return call()

    return contextvars.copy_context().run(with_fresh_id)
