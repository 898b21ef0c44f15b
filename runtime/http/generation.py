"""Running one HTTP request's engine requests: concurrency, disconnects, aborts, and the wire formats.

An HTTP request may fan out into several engine requests (`n` choices, several prompts). `GenerationRun`
starts them all concurrently on the server's event loop and yields `(index, chunk)` pairs as the engine
produces them (one final result per request when not streaming, incremental chunks when streaming).

Guarantees:
- the run is admitted into `InflightRequests` when created (so a full server answers 503 at once) and
  released by `close()`, which every route calls in a `finally`;
- a client that disconnects is noticed at once: one task per run waits on the ASGI receive channel for
  `http.disconnect` (no polling, so a thousand requests waiting for their first token cost nothing while they
  wait), the run stops and every engine request it started that has not finished is aborted, so its KV is
  released. Once a stream's response has started on a server whose ASGI spec is below 2.4, Starlette's own
  listener notices the disconnect and cancels the response (which closes the run), so the run's watcher
  stops and a chunk costs one queue read;
- `close()` is synchronous, so it also runs when the route's task is being cancelled (Starlette cancels a
  streaming response when the client goes away; uvicorn cancels requests at the end of a drain);
- engine ValueErrors become 400s, a request the engine failed alone gets its own status, a dead engine 503,
  anything else 500, via `APIError`; internal details (tracebacks, exception texts) stay in the server log.
- a client that leaves is an ordinary event, never an error: `install_disconnect_handlers` answers a
  disconnect that escapes a route (before the response started, or while the body was being read) with 499
  and one info line, where it would otherwise reach uvicorn as an ERROR traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Optional

import orjson
from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.errors import APIError, engine_unavailable, from_value_error
from radixserve.runtime.wire.errors import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
_END = object()
_DISCONNECTED = object()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that closed the connection before the answer


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


def install_disconnect_handlers(app: FastAPI) -> None:
    for disconnect in (ClientDisconnected, ClientDisconnect):  # ours, and Starlette's while reading the body
        app.add_exception_handler(disconnect, _client_left)


async def _client_left(request: Request, _: Exception) -> Response:
    logger.info("client disconnected: %s %s", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def json_response(content: Any, status_code: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS), status_code=status_code,
                    headers=headers, media_type="application/json")


def sse_event(content: Any) -> bytes:
    return b"data: " + orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def engine_error(state: ServerState, error: BaseException, param: Optional[str] = None) -> APIError:
    """What the engine raised, as the error the client sees: 400 for its own mistakes (ValueError), 503 when
    the engine is down, 500 otherwise. `param`: the request field a 400 is about, when the caller knows it."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestFailedError):
        if error.status_code < 500:
            return APIError(str(error), status_code=error.status_code)
        return APIError(str(error), status_code=error.status_code, type="server_error")
    if isinstance(error, ValueError):
        return from_value_error(error, param=param or getattr(error, "field", None))
    if isinstance(error, EngineDeadError) or not _is_healthy(state):
        logger.warning("request failed: the engine is not available (%s)", error)
        return engine_unavailable()
    logger.error("engine request failed", exc_info=error)
    return APIError("the engine failed to serve the request (see the server log)", status_code=500,
                    type="server_error")



def _is_healthy(state: ServerState) -> bool:
    try:
        return bool(state.engine.is_healthy())
    except Exception:  # a dead engine may fail to even answer
        return False


class GenerationRun:
    """Engine requests of one HTTP request, run concurrently; see the module docstring for the contract."""

    def __init__(
        self,
        state: ServerState,
        handles: dict[str, list[str]],
        requests: list[Any],
        tenant: Optional[str],
        http_request: Optional[Request],
    ) -> None:
        """`requests` are GenerateReqInput objects; `handles` maps each id the client knows to every rid it
        creates in the engine (several when the engine expands `n`), for admission and abort."""
        self._state = state
        self._handles = handles
        self._requests = requests
        self._engine_rids = [rid for rids in handles.values() for rid in rids]
        self._http_request = http_request
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._pending = set(range(len(requests)))
        self._closed = False
        self._watcher: Optional[asyncio.Task] = None
        self._tenant = tenant
        state.inflight.admit(handles, tenant)

    async def _pump(self, index: int, request: Any) -> None:
        try:
            async for chunk in self._state.engine.generate_request(request):
                self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the consumer, which owns error reporting
            self._queue.put_nowait((index, error))

    async def _watch_disconnect(self, receive: Any) -> None:
        """Wait for the client's `http.disconnect` (the body has been read by now; any other message is
        skipped) and hand it to the consumer. A channel that fails is a client that left."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as error:
            logger.debug("receive channel failed: %r", error)
        self._queue.put_nowait((-1, _DISCONNECTED))

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield `(request index, engine chunk)` until every request has finished.

        Raises APIError if the engine rejects or fails a request, ClientDisconnected if the client leaves."""
        if not self._tasks and not self._closed:
            self._tasks = [asyncio.ensure_future(self._pump(i, r)) for i, r in enumerate(self._requests)]
            if self._http_request is not None:
                self._watcher = asyncio.ensure_future(self._watch_disconnect(self._http_request.receive))
        while self._pending:
            index, item = self._queue.get_nowait() if not self._queue.empty() else await self._queue.get()
            if item is _END:
                self._pending.discard(index)
            elif item is _DISCONNECTED:
                self.close()
                raise ClientDisconnected()
            elif isinstance(item, BaseException):
                self._pending.discard(index)
                raise engine_error(self._state, item)
            else:
                yield index, item

    async def collect(self) -> list[list[Any]]:
        """All chunks of every request (one final result each when not streaming), in request order."""
        results: list[list[Any]] = [[] for _ in self._requests]
        async for index, chunk in self.events():
            results[index].append(chunk)
        return results

    def response_watches_disconnect(self) -> None:
        """The streaming response has started: where Starlette listens for the client's disconnect itself
        (ASGI spec below 2.4), stop watching for it here."""
        if self._http_request is None or self._watcher is None:
            return
        spec = self._http_request.scope.get("asgi", {}).get("spec_version", "2.0")
        if tuple(int(part) for part in spec.split(".")) < (2, 4):
            self._watcher.cancel()

    def close(self) -> None:
        """Stop the run: abort the engine requests that have not finished, and release the admission."""
        if self._closed:
            return
        self._closed = True
        unfinished = bool(self._pending)
        for task in self._tasks:
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        if unfinished:
            for rid in self._engine_rids:
                try:
                    self._state.engine.abort(rid, self._tenant)
                except Exception as error:  # the engine may already be gone; nothing is left to free then
                    logger.warning("abort of %s failed: %r", rid, error)
        self._state.inflight.release(list(self._handles), self._tenant)


async def start_stream(run: GenerationRun) -> AsyncIterator[tuple[int, Any]]:
    """Wait for the run's first event and return an iterator over all its events.

    Waiting first means an engine that rejects the request at once still gets an HTTP error status (400)
    instead of an error inside a 200 event stream."""
    events = run.events()
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None

    async def chained() -> AsyncIterator[tuple[int, Any]]:
        if first is None:
            return
        yield first
        run.response_watches_disconnect()
        async for event in events:
            yield event

    return chained()


async def respond(
    run: GenerationRun,
    stream: bool,
    render_result: Callable[[list[list[Any]]], Any],
    render_events: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[Any]],
    write_events: Optional[Callable[["GenerationRun", AsyncIterator[Any]], AsyncIterator[bytes]]] = None,
) -> Response:
    """The answer of a generation route, and the end of its run however the answer ends.

    Not streaming: every request's chunks (`GenerationRun.collect`) go to `render_result`, whose value is the JSON
    body (499 when the client left first). Streaming: each value `render_events` yields from the run's events is
    one SSE `data:` event, then `data: [DONE]`; an error after the stream started becomes an error event (the
    status line is sent by then), a client that left ends the stream. A surface with its own event framing
    (Anthropic's, the Responses API's) passes `write_events` in place of the OpenAI one. The run is closed in every
    case."""
    if stream:
        try:
            events = await start_stream(run)
        except BaseException:
            run.close()
            raise
        return RunStreamingResponse((write_events or _sse)(run, render_events(events)), run)
    try:
        results = await run.collect()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        run.close()
    return json_response(render_result(results))


async def _sse(run: GenerationRun, payloads: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    try:
        async for payload in payloads:
            yield sse_event(payload)
    except APIError as error:
        yield sse_event(error.body())
    except ClientDisconnected:
        return
    finally:
        run.close()
    yield SSE_DONE


class RunStreamingResponse(StreamingResponse):
    """A streaming response that closes its GenerationRun however the response ends, even when Starlette
    cancels it before the body iterator ever started (a client that left at once)."""

    def __init__(self, content: AsyncIterator[bytes], run: GenerationRun) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()
