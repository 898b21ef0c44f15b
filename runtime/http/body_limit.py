"""`--max-request-bytes`: an ASGI middleware that refuses request bodies past the limit with a 413.

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


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
