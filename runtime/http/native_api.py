"""The native (SGLang-style) routes: /generate, health, cache and server-info RPCs.

`POST /generate` is the Engine's generate over HTTP: `text` or `input_ids`, single or batch, SGLang
`sampling_params`, SSE when `stream` is true (`data: {chunk}` events, then `data: [DONE]`). The result
and chunk shapes are the Engine's (a chunk holds the whole output so far unless the server runs with
--incremental-streaming-output). The body decodes into the wire's GenerateRequest, which `normalize` checks
(runtime/wire/request.py); SGLang's other request fields pass when they ask for nothing (wire/compat.py).
Client-chosen `rid`s must be unique among requests in flight; the caller
may abort its own requests with `POST /abort_request {"rid": ...}` (another tenant's rid is "not found").
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any, AsyncIterator, Optional

import msgspec
from fastapi import APIRouter, Depends
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.errors import APIError, bad_request, from_value_error
from radixserve.runtime.http.extension_fields import unsupported_field
from radixserve.runtime.http.generation import GenerationRun, json_response, respond
from radixserve.runtime.http.openai.protocol import StrictModel, parse_request
from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.state import ServerState, caller, caller_tenant
from radixserve.runtime.pooling import embed_request
from radixserve.runtime.tenancy import Caller
from radixserve.runtime.wire.cache_info import NamespaceCounters
from radixserve.runtime.wire.compat import UnsupportedFieldError
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest, RequestFieldError, normalize
from radixserve.runtime.wire.request_body import decode_json
from radixserve.runtime.wire.server_info import ReplicaView

HEALTH_GENERATE_TIMEOUT_SECONDS = 30.0
Rid = Annotated[str, Field(min_length=1, max_length=256)]


def _decode(state: ServerState, raw: bytes, tenant: Optional[str]) -> NormalizedRequest:
    """The body as the normalized request of `tenant` (the API key's, never the body's); a 400 naming the field
    at fault (a sampling parameter of a batch's prompt as `sampling_params[i].name`)."""
    try:
        body = decode_json(raw)
    except UnsupportedFieldError as error:
        raise unsupported_field(error) from None
    except RequestFieldError as error:
        raise bad_request(str(error), param=error.field) from None
    body = msgspec.structs.replace(body, tenant=tenant, tenant_weight=state.tenants.weight_of(tenant))
    try:
        return normalize(body, state.model_info)
    except ValueError as error:
        field = getattr(error, "field", None)
        if field is not None and field.startswith("sampling_params"):
            prompt = getattr(error, "prompt", None)
            param = ("sampling_params" if prompt is None else f"sampling_params[{prompt}]") + field[len(
                "sampling_params"):]
            raise bad_request(f"{param}: {getattr(error, 'reason', error)}", param=param) from None
        raise from_value_error(error, param=field) from None


class _RidBody(StrictModel):
    rid: Rid


def _state(request: Request) -> ServerState:
    return request.app.state.server


tenant_routes = access_router(Access.TENANT)
admin_routes = access_router(Access.ADMIN)
public_routes = access_router(Access.PUBLIC)


@tenant_routes.post("/generate")
async def generate(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    normalized = _decode(state, await request.body(), tenant)
    run = GenerationRun(state, normalized.sample_rids(), [normalized], tenant, request)
    return await respond(run, normalized.stream, _final_result, _chunks)


def _final_result(results: list[list[Any]]) -> Any:
    return results[0][-1] if results[0] else None


async def _chunks(events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[Any]:
    async for _, chunk in events:
        yield chunk


@tenant_routes.post("/abort_request")
async def abort_request(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body: _RidBody = parse_request(_RidBody, await request.body())
    rids = state.inflight.engine_rids_owned(body.rid, tenant)
    if rids is None:
        raise APIError(f"no running request with id {body.rid!r}", status_code=404, param="rid",
                       code="request_not_found")
    for rid in rids:
        state.engine.abort(rid, tenant)
    return json_response({"success": True})


@admin_routes.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    flushed = await _state(request).engine.async_flush_cache()
    if not flushed:
        raise APIError("The cache was not flushed: requests are running. Retry when the server is idle.",
                       headers={"Retry-After": "1"})
    return json_response({"success": True, "message": "Cache flushed."})


@tenant_routes.get("/model_info")
@tenant_routes.get("/get_model_info")
async def get_model_info(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    return json_response({
        "model_path": state.model_info.model_path,
        "tokenizer_path": state.server_args.tokenizer_path or state.model_info.tokenizer_path,
        "served_model_name": state.served_model_name,
        "is_generation": True,
        "context_length": state.context_len,
        "vocab_size": state.vocab_size,
        "info": state.model_info.to_dict(),
    })


@tenant_routes.get("/server_info")
@tenant_routes.get("/get_server_info")
async def get_server_info(request: Request, who: Caller = Depends(caller)) -> Response:
    """The administrator sees everything; a tenant sees the model's facts and its own namespaces and requests,
    nothing of the server's traffic (which would show other tenants' activity). Both views carry SGLang's
    top-level `incremental_streaming_output` (how /generate streams) and `internal_states` (one entry per
    scheduler, which SGLang's bench_serving reads at the end of a run; empty of traffic figures for a tenant)."""
    state = _state(request)
    info = await state.engine.async_server_info()
    if who.is_admin:
        body = info.to_dict()
    else:
        body = {**state.model_info.to_dict(), "cache": _own_cache(_own_namespaces(info.cache.namespaces, who.tenant))}
        if info.retention is not None:  # its own retained sessions' use of its quota
            body["retention"] = {"retained_tokens": info.retention.tokens_by_tenant.get(who.tenant or "", 0),
                                 "tenant_quota_tokens": info.retention.tenant_quota_tokens}
    body["incremental_streaming_output"] = _streams_incrementally(state)
    body["internal_states"] = [_internal_state(view) if who.is_admin else {}
                               for view in info.replicas or [info.replica_view()]]
    if state.tenant_usage is not None:  # a tenant sees its own usage, the administrator every tenant's
        body["tenant_usage"] = (state.tenant_usage.all_totals() if who.is_admin
                                else state.tenant_usage.totals_of(who.tenant))
    body["http"] = {"served_model_name": state.served_model_name,
                    "inflight_engine_requests": state.inflight.num_engine_requests_of(who.tenant)}
    if who.is_admin:
        body["http"].update(inflight_requests=len(state.inflight), capacity=state.inflight.capacity,
                            inflight_engine_requests=state.inflight.num_engine_requests)
    return json_response(body)


def _own_cache(namespaces: dict[str, NamespaceCounters]) -> dict[str, Any]:
    """A tenant's cache statistics: its namespaces, and the totals over them (its own hit rate, evictions)."""
    queried = sum(counters.queried_tokens for counters in namespaces.values())
    matched = sum(counters.matched_tokens for counters in namespaces.values())
    evicted = sum(counters.evicted_tokens for counters in namespaces.values())
    return {"hit_rate": matched / queried if queried else 0.0, "matched_tokens": matched, "queried_tokens": queried,
            "tree": {"evicted_tokens": evicted},
            "namespaces": {name: counters.to_dict() for name, counters in namespaces.items()}}


def _streams_incrementally(state: ServerState) -> bool:
    """The streaming mode of the engine behind the server (its own ServerArgs, which may differ from the app's)."""
    return state.engine.server_args.incremental_streaming_output


def _internal_state(replica: ReplicaView) -> dict[str, Any]:
    """A scheduler's state under SGLang's names (avg_spec_accept_length only with speculative decoding)."""
    state = {"last_gen_throughput": replica.gen_throughput, "token_usage": replica.token_usage,
             "dp_rank": replica.dp_rank, "num_running_reqs": replica.num_running_reqs,
             "num_queued_reqs": replica.num_queued_reqs}
    if replica.avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = replica.avg_spec_accept_length
    return state


def _own_namespaces(namespaces: dict[str, NamespaceCounters], tenant: Optional[str]) -> dict[str, NamespaceCounters]:
    """The per-namespace cache statistics of the caller's own namespaces (the names of the others would reveal
    other tenants and their salts; salts are listed only as digests anyway)."""
    if tenant is None:
        return {name: counters for name, counters in namespaces.items() if not name.startswith("tenant:")}
    own = f"tenant:{tenant}"
    return {name: counters for name, counters in namespaces.items() if name == own or name.startswith(own + "/")}


@tenant_routes.get("/health_generate")
async def health_generate(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    """Healthy only if the engine really produces a token within the timeout."""
    state = _state(request)
    rid = f"health-{uuid.uuid4().hex}"
    probe = GenerateRequest(text="ping", sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid)
    if not state.model_info.is_generation:  # a model that only pools is probed with what it serves
        probe = embed_request(state.model_info, ["ping"], rid=rid)

    async def one_token() -> Any:
        result = None
        async for result in state.engine.generate_request(probe):
            pass
        return result

    try:
        # On timeout, cancelling the iteration aborts the probe in the engine.
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_SECONDS)
    except Exception as error:
        raise APIError(f"health check generation failed: {type(error).__name__}: {error}", status_code=503,
                       type="server_error") from None
    return json_response({"healthy": True})


@public_routes.get("/health")
async def health_route(request: Request) -> Response:
    """GET /health (open, no key): 200 when the engine is up and the server is not draining, else 503."""
    state = _state(request)
    healthy = not state.inflight.draining
    if healthy:
        try:
            healthy = bool(state.engine.is_healthy())
        except Exception:
            healthy = False
    if not healthy:
        return APIError("unhealthy", status_code=503, type="server_error").response()
    return Response(status_code=200)


router = APIRouter()  # the native routes; each keeps the class of the router it was declared on
router.include_router(public_routes)
router.include_router(tenant_routes)
router.include_router(admin_routes)
