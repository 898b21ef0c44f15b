"""The native (SGLang-style) routes: /generate, health, cache and server-info RPCs.

`POST /generate` is the Engine's generate over HTTP: `text` or `input_ids`, single or batch, SGLang
`sampling_params`, SSE when `stream` is true (`data: {chunk}` events, then `data: [DONE]`). The result
and chunk shapes are the Engine's (a chunk holds the whole output so far unless the server runs with
--incremental-streaming-output). SGLang's other request fields are accepted at their default
(extension_fields.py). Client-chosen `rid`s must be unique among requests in flight; the caller
may abort its own requests with `POST /abort_request {"rid": ...}` (another tenant's rid is "not found").
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Depends
from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.generation import GenerationRun, json_response, respond
from radixserve.runtime.http.state import ServerState, caller, caller_tenant, require_admin
from radixserve.runtime.http.extension_fields import NATIVE_LABELS, NATIVE_UNSUPPORTED, absorb, is_default
from radixserve.runtime.tenancy import Caller
from radixserve.runtime.http.errors import APIError, bad_request
from radixserve.runtime.http.openai.protocol import MAX_TOP_LOGPROBS, StrictModel, TokenId, parse_request
from radixserve.runtime.wire.sampling_params import InvalidSamplingParams, SamplingParams
from radixserve.runtime.wire.server_info import NamespaceCounters, ReplicaView
from radixserve.tokenizer_manager.io import GenerateReqInput

HEALTH_GENERATE_TIMEOUT_SECONDS = 30.0
MAX_BATCH = 1024
Rid = Annotated[str, Field(min_length=1, max_length=256)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[int, Field(ge=-1, le=2**31)]
DpRank = Annotated[int, Field(ge=0, le=1 << 16)]


_NULL_IS_DEFAULT = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream")


Priority = Annotated[int, Field(ge=-(2**63 - 1), le=2**63 - 1)]


class NativeGenerateRequest(StrictModel):
    text: Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)], None] = None
    input_ids: Union[
        Annotated[list[TokenId], Field(min_length=1)],
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH)],
        None,
    ] = None
    # Checked by SamplingParams.from_request (the one validator), not here.
    sampling_params: Union[dict[str, Any], list[Optional[dict[str, Any]]], None] = None
    rid: Union[Rid, list[Rid], None] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[LogprobStart, list[LogprobStart]] = -1
    top_logprobs_num: Union[TopLogprobs, list[TopLogprobs]] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: Union[Annotated[str, Field(max_length=256)], list[Annotated[str, Field(max_length=256)]], None] = None
    priority: Union[Priority, list[Optional[Priority]], None] = None  # --enable-priority-scheduling
    lora_path: Union[str, list[Optional[str]], None] = None  # a LoRA adapter's name, per prompt or for all
    # SGLang's two names for the data-parallel replica to run on (sglang-router --dp-aware sends one).
    data_parallel_rank: Optional[DpRank] = None
    routed_dp_rank: Optional[DpRank] = None

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        """SGLang's fields without a feature here pass at their default (extension_fields.py); SGLang's null
        for a field with a default means that default."""
        data = absorb(data, NATIVE_UNSUPPORTED, NATIVE_LABELS)
        if isinstance(data, dict) and is_default(data.get("lora_path")):
            data.pop("lora_path", None)  # SGLang's clients send null (or [null] per prompt) for the base model
        if isinstance(data, dict):
            data = {name: value for name, value in data.items() if value is not None or name not in _NULL_IS_DEFAULT}
        return data

    @model_validator(mode="after")
    def _check(self) -> "NativeGenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        size = self.batch_size
        for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "cache_salt", "priority", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list):
                if size is None:
                    raise ValueError(f"{name} is a list but the request is not a batch")
                if len(value) != size:
                    raise ValueError(f"{name} has {len(value)} entries for a batch of {size}")
            elif name == "rid" and value is not None and size is not None:
                raise ValueError("a batch needs a list of rids")
        if self.input_ids is not None and size is None:
            # One prompt's ids live as long as its stream: as a tuple of ints the cyclic garbage collector stops
            # tracking them, where a list would be walked by every full collection (see split_requests).
            self.input_ids = tuple(self.input_ids)  # type: ignore[assignment]
        return self

    @property
    def batch_size(self) -> Optional[int]:
        """None for a single request, else the number of prompts."""
        if isinstance(self.text, list):
            return len(self.text)
        if self.input_ids and isinstance(self.input_ids[0], list):
            return len(self.input_ids)
        return None

    def item(self, name: str, i: int) -> Any:
        value = getattr(self, name)
        return value[i] if isinstance(value, list) else value


def _sampling(state: ServerState, body: NativeGenerateRequest, i: int) -> SamplingParams:
    try:
        return SamplingParams.from_request(body.item("sampling_params", i), state.vocab_size,
                                           state.model_info.sampling_defaults)
    except InvalidSamplingParams as error:
        where = "sampling_params" if body.batch_size is None else f"sampling_params[{i}]"
        param = where if error.field is None else f"{where}.{error.field}"
        raise bad_request(f"{param}: {error}", param=param) from None


def _engine_rids(rid: str, params: SamplingParams) -> list[str]:
    """The rids the engine creates for one prompt: the rid itself, or `{rid}-{i}` per sample when n > 1."""
    return [f"{rid}-{i}" for i in range(params.n)] if params.n > 1 else [rid]


def _build(state: ServerState, body: NativeGenerateRequest, tenant: Optional[str]) -> tuple[Any, dict[str, list[str]]]:
    size = body.batch_size
    count = 1 if size is None else size
    if isinstance(body.rid, list):
        rids = list(body.rid)
    elif size is None:
        rids = [body.rid or uuid.uuid4().hex]
    else:
        rids = [uuid.uuid4().hex for _ in range(count)]
    params = [_sampling(state, body, i) for i in range(count)]
    handles = {rids[i]: _engine_rids(rids[i], params[i]) for i in range(count)}
    if len(handles) != count:
        raise bad_request("rids in a batch must be distinct", param="rid")
    sampling: Any = params[0] if size is None else params
    request = GenerateReqInput(
        text=body.text,
        input_ids=body.input_ids,
        sampling_params=sampling,
        rid=rids[0] if size is None else rids,
        return_logprob=body.return_logprob,
        logprob_start_len=body.logprob_start_len,
        top_logprobs_num=body.top_logprobs_num,
        return_text_in_logprobs=body.return_text_in_logprobs,
        stream=body.stream,
        cache_salt=body.cache_salt,
        priority=body.priority,
        lora_path=body.lora_path,
        data_parallel_rank=body.data_parallel_rank if body.routed_dp_rank is None else body.routed_dp_rank,
        tenant=tenant,
        tenant_weight=state.tenants.weight_of(tenant),
    )
    return request, handles


class _RidBody(StrictModel):
    rid: Rid


def _state(request: Request) -> ServerState:
    return request.app.state.server


router = APIRouter()


@router.post("/generate")
async def generate(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body: NativeGenerateRequest = parse_request(NativeGenerateRequest, await request.body())
    engine_request, handles = _build(state, body, tenant)
    run = GenerationRun(state, handles, [engine_request], tenant, request)
    return await respond(run, body.stream, _final_result, _chunks)


def _final_result(results: list[list[Any]]) -> Any:
    return results[0][-1] if results[0] else None


async def _chunks(events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[Any]:
    async for _, chunk in events:
        yield chunk


@router.post("/abort_request")
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


@router.post("/flush_cache")
async def flush_cache(request: Request, who: Caller = Depends(caller)) -> Response:
    require_admin(who, "Flushing the cache")
    flushed = await _state(request).engine.async_flush_cache()
    if not flushed:
        raise APIError("The cache was not flushed: requests are running. Retry when the server is idle.",
                       headers={"Retry-After": "1"})
    return json_response({"success": True, "message": "Cache flushed."})


@router.get("/model_info")
@router.get("/get_model_info")
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


@router.get("/server_info")
@router.get("/get_server_info")
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


@router.get("/health_generate")
async def health_generate(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    """Healthy only if the engine really produces a token within the timeout."""
    state = _state(request)
    rid = f"health-{uuid.uuid4().hex}"
    probe = GenerateReqInput(text="ping",
                             sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid)

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
