"""The HTTP server: a FastAPI app over one engine, served by uvicorn (uvloop), with graceful shutdown.

    launch_server(ServerArgs(...))        # blocks; what `radixserve serve` runs
    app = create_app(engine, server_args) # the ASGI app alone, over a ServingEngine the caller owns (an Engine,
                                          # or the Ray ingress's proxy; runtime/serving_engine.py)

Routes: OpenAI `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/v1/models/{id}`; native
`/generate`, `/abort_request`, `/flush_cache`, `/get_model_info`, `/get_server_info`, `/health_generate`
(see native_api.py); vLLM's `/version`, `/ping`, `/tokenize`, `/detokenize` (vllm_api.py). Each route is registered with its class (runtime/http/access.py): public (`/health`),
tenant (needs the API key when one is configured) or admin (acts on or shows every tenant: `/flush_cache`,
`/metrics`, adapter loading; the caller must be the administrator, runtime/tenancy.py); `create_app` refuses a
route without a class. Every error uses the OpenAI envelope (errors.py).

SIGTERM (or Ctrl-C): stop accepting connections, let in-flight requests finish for up to
`--graceful-shutdown-timeout` seconds, abort what is left (those responses end with finish_reason "abort"),
shut the engine and its processes down, and exit 0. A child process that dies fails every pending request
(503), stops the other child, and ends the server with exit code 1, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import uuid
from typing import Any, AsyncIterator, Optional

import uvicorn
from fastapi import Depends, FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.anthropic.messages import router as anthropic_router
from radixserve.runtime.http.access import Access, access_router, check_route_classes, mark_openapi_public
from radixserve.runtime.http.body_limit import BodyLimitMiddleware, HeaderLimitMiddleware
from radixserve.runtime.http.cache_page import router as cache_page_router
from radixserve.runtime.http.generation import install_disconnect_handlers, json_response
from radixserve.runtime.http.state import InflightRequests, ServerState, caller_tenant
from radixserve.runtime.http.lora_api import adapter_cards
from radixserve.runtime.http.lora_api import router as lora_router
from radixserve.runtime.http.pooling_api import router as pooling_router
from radixserve.runtime.pooling import embed_request
from radixserve.runtime.http.weights_api import router as weights_router
from radixserve.runtime.http.weights_api import version_router as weight_version_router
from radixserve.runtime.http.metrics import ServerMetrics
from radixserve.runtime.http.tenant_usage import TenantUsage
from radixserve.runtime.http.native_api import router as native_router
from radixserve.runtime.http.errors import APIError, install_error_handlers
from radixserve.runtime.http.openai.logprobs import TokenTexts
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from radixserve.runtime.http.openai.serving_chat import create_chat_completion, encode_chat
from radixserve.runtime.http.openai.serving_completions import create_completion
from radixserve.runtime.http.openai.response_store import ResponseStore
from radixserve.runtime.http.openai.responses import router as responses_router
from radixserve.runtime.http.openapi import install_openapi
from radixserve.runtime.http.vllm_api import router as vllm_router
from radixserve.runtime.wire.heap import settle_heap
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.runtime.serving_engine import ServingEngine
from radixserve.runtime.tenancy import TenantResolver
from radixserve.tokenizer_manager.tokenize import load_chat_template
from radixserve.tokenizer_manager.io import GenerateReqInput

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_SECONDS = 120.0
# After the drain timeout aborts what is left, aborted requests still need a moment to send their last chunk.
ABORT_GRACE_SECONDS = 5.0
# An idle keep-alive connection stays open longer than client pools and proxies keep theirs (httpx and so the
# openai client 5 s, aiohttp 15 s, nginx and cloud load balancers 60 s), so the client always closes it first.
# A server that closes first races the client's next request on that socket, which then fails with a reset.
KEEP_ALIVE_SECONDS = 75


def served_model_name(server_args: ServerArgs) -> str:
    """The model id of the OpenAI API: --served-model-name, else --model-path, else the embedded model's name."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path:
        return server_args.model_path
    from radixserve.runtime.model_files import DEFAULT_MODEL_FILE

    return DEFAULT_MODEL_FILE.split(".", 1)[0]


def create_app(engine: ServingEngine, server_args: ServerArgs) -> FastAPI:
    """The ASGI app serving `engine` (a started Engine or the Ray ingress's proxy, owned by the caller)."""
    if not isinstance(engine, ServingEngine):
        raise TypeError(f"create_app serves a ServingEngine (runtime/serving_engine.py); a {type(engine).__name__} "
                        "lacks some of its members")
    model_info = engine.model_info
    capacity = model_info.max_running_requests * model_info.dp_size + server_args.resolved_max_queued_requests()
    state = ServerState(
        engine=engine,
        server_args=server_args,
        tenants=TenantResolver.from_server_args(server_args.api_key, server_args.tenants_file,
                                                server_args.admin_api_key),
        inflight=InflightRequests(capacity, server_args.max_sequences_per_request),
        tokenizer=engine.tokenizer,
        served_model_name=served_model_name(server_args),
        model_info=model_info,
        context_len=model_info.context_len,
        vocab_size=model_info.vocab_size,
        max_total_tokens=model_info.max_total_num_tokens,
        token_texts=TokenTexts(engine.tokenizer),
    )
    state.tenant_usage = TenantUsage(state.tenants.tenant_ids)
    if server_args.enable_metrics:
        state.metrics = ServerMetrics(state.served_model_name, state.tenant_usage)
    engine.request_observer = state.observe_request

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if server_args.chat_template is not None:  # fail at start-up, not on the first chat request
            from radixserve.runtime.http.openai.protocol import ChatMessage

            await encode_chat(state, [ChatMessage(role="user", content="hello")])
        if not server_args.skip_server_warmup:
            await asyncio.wait_for(_warmup(state), WARMUP_TIMEOUT_SECONDS)
        # What start-up loaded stays out of the collections that run while requests stream (runtime/wire/heap.py).
        settle_heap(server_args.gc_threshold, server_args.gc_warning_threshold_secs)
        yield

    app = FastAPI(title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=server_args.max_header_bytes)
    install_error_handlers(app)
    install_disconnect_handlers(app)
    admin = access_router(Access.ADMIN)
    admin.add_api_route("/metrics", _metrics, methods=["GET"])
    app.include_router(admin)
    protected = access_router(Access.TENANT)
    protected.add_api_route("/v1/models", _list_models, methods=["GET"])
    protected.add_api_route("/v1/models/{model_id:path}", _get_model, methods=["GET"])
    protected.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"])
    protected.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.include_router(protected)
    app.include_router(native_router)
    app.include_router(lora_router)  # /load_lora_adapter, /unload_lora_adapter (runtime/http/lora_api.py)
    app.include_router(weights_router)  # weight updates, memory, pause (runtime/http/weights_api.py)
    app.include_router(weight_version_router)  # /get_weight_version
    app.include_router(cache_page_router)  # /cache (the page) and /cache/tree (runtime/http/cache_page.py)
    app.include_router(pooling_router)  # /v1/embeddings, /v1/rerank, /v1/score, /classify (runtime/http/pooling_api.py)
    app.include_router(vllm_router)  # /version, /ping, /tokenize, /detokenize (runtime/http/vllm_api.py)
    app.include_router(anthropic_router)  # /v1/messages, /v1/messages/count_tokens (runtime/http/anthropic/)
    app.state.responses = ResponseStore()
    app.include_router(responses_router)  # /v1/responses (runtime/http/openai/responses.py)
    install_openapi(app)
    mark_openapi_public(app)
    check_route_classes(app)  # a route without a class (public, tenant, admin) fails here, at start-up
    return app


async def _warmup(state: ServerState) -> None:
    """Tiny generations before serving, so the first client does not pay for lazy initialisation: one plain,
    one JSON-constrained (which builds the grammar compiler's tokenizer tables)."""
    one_token = {"max_new_tokens": 1, "temperature": 0.0}
    requests = [GenerateReqInput(text="Hello", sampling_params=one_token, rid=f"warmup-{uuid.uuid4().hex}"),
                GenerateReqInput(text="Hello", rid=f"warmup-json-{uuid.uuid4().hex}",
                                 sampling_params={**one_token, "json_schema": '{"type": "object"}'})]
    if not state.model_info.is_generation:  # a model that only pools warms up on what it serves
        requests = [embed_request(state.model_info, ["Hello"], rid=f"warmup-{uuid.uuid4().hex}")]

    async def run(request: GenerateReqInput) -> Any:
        result = None
        async for result in state.engine.generate_request(request):
            pass
        return result

    results = await asyncio.gather(*(run(r) for r in requests))
    results = [r[0] if isinstance(r, list) else r for r in results]  # an embedding request answers a list
    logger.info("warm-up done: %s", [r["meta_info"]["finish_reason"] for r in results])


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "radixserve",
            "root": state.served_model_name, "max_model_len": state.context_len}


async def _list_models(request: Request) -> Response:
    state = _state(request)
    return json_response({"object": "list", "data": [_model_card(state), *adapter_cards(state)]})


async def _get_model(request: Request, model_id: str) -> Response:
    state = _state(request)
    if model_id != state.served_model_name:
        card = next((card for card in adapter_cards(state) if card["id"] == model_id), None)
        if card is None:
            raise APIError(f"The model '{model_id}' does not exist.", status_code=404, param="model",
                           code="model_not_found")
        return json_response(card)
    return json_response(_model_card(state))


async def _chat_completions(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    body = parse_request(ChatCompletionRequest, await request.body())
    return await create_chat_completion(_state(request), request, body, tenant)


async def _completions(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    body = parse_request(CompletionRequest, await request.body())
    return await create_completion(_state(request), request, body, tenant)


async def _metrics(request: Request) -> Response:
    state = _state(request)
    if state.metrics is None:
        raise APIError("metrics are disabled", status_code=404, code="not_found")
    try:
        info: Optional[ServerInfo] = await asyncio.wait_for(state.engine.async_server_info(), 5.0)
    except Exception:  # a scrape must still answer when the scheduler is busy or down
        info = None
    body, content_type = state.metrics.render(info, state.inflight.num_engine_requests)
    return Response(body, media_type=content_type)


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown, plus: refuse new requests at once, abort what is left after the drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_seconds = drain_seconds

    async def shutdown(self, sockets: Any = None) -> None:
        self._state.inflight.draining = True
        logger.info("shutting down: draining %d in-flight request(s) for up to %.0f s",
                    len(self._state.inflight), self._drain_seconds)
        timer = asyncio.get_running_loop().call_later(self._drain_seconds, self._abort_remaining)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_remaining(self) -> None:
        rids = self._state.inflight.all_engine_rids()
        if rids:
            logger.warning("drain timeout: aborting %d request(s)", len(rids))
        for tenant, rid in rids:
            try:
                self._state.engine.abort(rid, tenant)
            except Exception as error:
                logger.warning("abort of %s failed: %r", rid, error)


def launch_server(server_args: ServerArgs) -> None:
    """Start the Engine and serve HTTP until SIGTERM / SIGINT; returns after a clean shutdown."""
    from radixserve.runtime.engine import Engine

    # Configuration mistakes should fail before the (slow) engine start.
    TenantResolver.from_server_args(server_args.api_key, server_args.tenants_file, server_args.admin_api_key)
    load_chat_template(server_args.chat_template)  # a missing file fails before the engine starts
    engine = Engine(**server_args.to_dict())
    try:
        app = create_app(engine, server_args)
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level.lower(),
            loop="uvloop" if _has_uvloop() else "asyncio",
            timeout_graceful_shutdown=int(server_args.graceful_shutdown_timeout + ABORT_GRACE_SECONDS) + 1,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            h11_max_incomplete_event_size=server_args.max_header_bytes,
        )
        server = _DrainingServer(config, app.state.server, server_args.graceful_shutdown_timeout)
        failure: list[str] = []

        def on_engine_death(reason: str) -> None:
            # A dead child ends the whole server with a non-zero exit, so a supervisor (systemd, Kubernetes)
            # restarts it instead of leaving a server that answers 503 forever.
            logger.error("the engine failed (%s): shutting the server down", reason)
            failure.append(reason)
            server.should_exit = True

        engine.on_death = on_engine_death
        # uvicorn re-raises the signal it caught once it has shut down; with these no-op handlers in place
        # that re-raise is harmless and the process exits 0 after the engine is stopped below.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        server.run()
        if not server.started or failure:
            raise SystemExit(1)
    finally:
        engine.shutdown()


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
