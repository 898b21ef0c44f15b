"""`--max-request-bytes` and `--max-header-bytes`: ASGI middlewares that refuse request bodies past the limit
with a 413 and request heads (the path, query and headers) past theirs with a 431.

A declared `Content-Length` over the limit is refused before anything is read; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so a client cannot make the server buffer more than the
limit whatever it declares.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from radixserve.runtime.http.errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def body_too_large(max_bytes: int) -> APIError:
    return APIError(f"The request body is larger than the server's limit of {max_bytes} bytes "
                    "(--max-request-bytes).", status_code=413, code="request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        received = 0

        async def counting_receive() -> Message:
            # The route reading the body gets the APIError, which the app's error handlers answer (413).
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, send: Send) -> None:
        await body_too_large(self.max_bytes).response()({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


class HeaderLimitMiddleware:
    """A 431 for a request whose target and headers together exceed `max_bytes`, before any route runs.

    uvicorn's HTTP parser bounds a head only under h11 (`launch_server` passes the same limit there); under
    httptools it accepts any size, so the check also lives here, where every parser's requests pass."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _head_size(scope) > self.max_bytes:
            error = APIError(f"The request's headers are larger than the server's limit of {self.max_bytes} bytes "
                             "(--max-header-bytes).", status_code=431, code="headers_too_large")
            await error.response()({"type": "http"}, _no_body, send)
            return
        await self.app(scope, receive, send)


def _head_size(scope: Scope) -> int:
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return target + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))  # ": " and CRLF


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
