"""The OpenAI error envelope, and the mapping of every failure the HTTP layer sees onto it.

Every error the server returns, on every route, has the body
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Client mistakes are 4xx (never 5xx): 400 invalid input, 401 missing or wrong API key, 404 unknown model
or route, 405 wrong method. 503 (with `Retry-After`) means the server is full or shutting down; 500 is kept
for genuine server faults.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    405: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """An error answered with the OpenAI envelope; raise it anywhere inside a route."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: Optional[str] = None,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status_code,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(message, status_code=400, param=param, code=code)


def context_length_error(message: str, *, param: Optional[str] = None) -> APIError:
    return APIError(message, status_code=400, param=param, code=CONTEXT_LENGTH_EXCEEDED)


def engine_unavailable() -> APIError:
    """A dead engine: 503, and when to try again (a supervisor restarts the server)."""
    return APIError("The engine is not available.", status_code=503, type="server_error",
                    code="engine_unavailable", headers={"Retry-After": "5"})


def from_value_error(error: ValueError, param: Optional[str] = None) -> APIError:
    """The engine raises ValueError for bad arguments before queueing anything: always the client's fault."""
    from radixserve.runtime.wire.errors import ContextLengthExceededError

    message = str(error) or "invalid request"
    code = CONTEXT_LENGTH_EXCEEDED if isinstance(error, ContextLengthExceededError) else None
    return APIError(message, status_code=400, param=param, code=code)


_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list", "json-or-python"}


def _is_union_member_tag(item: Any) -> bool:
    """pydantic names the union member that failed (`list[int]`, `constrained-str`, `TextContentPart`) in the
    location; field names are lower_snake_case, so these tags are easy to tell apart."""
    text = str(item)
    return "[" in text or "-" in text or text in _TYPE_NAMES or text[:1].isupper()


def _location(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (the param name clients know)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _is_union_member_tag(item):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the alternatives a union reports, the deepest one that is not a mere type mismatch says most."""
    def score(error: dict[str, Any]) -> tuple[int, bool]:
        return len(error.get("loc", ())), not str(error.get("type", "")).endswith("_type")

    best = errors[0]
    for error in errors[1:]:
        if score(error) > score(best):
            best = error
    return best


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's error list into one 400, naming the first offending parameter like OpenAI does."""
    if not errors:
        return bad_request("invalid request body")
    unknown = [e for e in errors if e.get("type") == "extra_forbidden" and len(e.get("loc", ())) == 1]
    if unknown:
        param = _location(tuple(unknown[0]["loc"]))
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return bad_request(f"The request body is not valid JSON: {detail}".strip())
    if errors[0].get("type") in ("model_type", "model_attributes_type", "dict_type") and not errors[0].get("loc"):
        return bad_request("The request body must be a JSON object.")
    first = _most_specific(errors)
    param = _location(tuple(first.get("loc", ()))) or None
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return bad_request(f"{param}: {message}" if param else message, param=param)


def validation_error(error: pydantic.ValidationError) -> APIError:
    return from_validation_errors(error.errors(include_url=False, include_input=False))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI or Starlette raises through the envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        message = "Not found: no such route." if exc.status_code == 404 else str(exc.detail)
        return APIError(message, status_code=exc.status_code, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        from radixserve.runtime.wire.errors import EngineDeadError

        if isinstance(exc, EngineDeadError):
            return engine_unavailable().response()
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError("internal server error (see the server log)", status_code=500).response()
