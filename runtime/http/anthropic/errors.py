"""Anthropic's error envelope and API key header on the `/v1/messages` routes.

Every error of these routes has the body `{"type": "error", "error": {"type": ..., "message": ...}}` with
Anthropic's error type for its status (the SDK raises the matching exception class from the status); the rest of
the server keeps the OpenAI envelope (runtime/http/errors.py). The API key comes in `x-api-key`, Anthropic's header,
or in `Authorization: Bearer`, and selects the tenant as on every other route (runtime/tenancy.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Coroutine, Optional

import orjson
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from radixserve.runtime.http.errors import APIError, engine_unavailable
from radixserve.runtime.http.generation import ClientDisconnected
from radixserve.runtime.http.state import ServerState
from radixserve.runtime.tenancy import AuthenticationError
from radixserve.runtime.wire.errors import EngineDeadError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPE_BY_STATUS.get(error.status_code, "api_error"),
                                       "message": error.message}}


def error_response(error: APIError) -> Response:
    return Response(orjson.dumps(error_body(error)), status_code=error.status_code, headers=error.headers,
                    media_type="application/json")


class AnthropicRoute(APIRoute):
    """A route whose errors, its dependencies' included, are answered in Anthropic's envelope."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as error:
                return error_response(error)
            except (ClientDisconnected, ClientDisconnect):
                raise
            except EngineDeadError:
                return error_response(engine_unavailable())
            except Exception as error:
                logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
                return error_response(APIError("internal server error (see the server log)", status_code=500))

        return route


def api_key_tenant(request: Request) -> Optional[str]:
    """FastAPI dependency: the tenant of the `x-api-key` (else `Authorization`) header, or a 401."""
    state: ServerState = request.app.state.server
    key = request.headers.get("x-api-key")
    authorization = f"Bearer {key}" if key is not None else request.headers.get("authorization")
    try:
        return state.tenants.tenant_for(authorization)
    except AuthenticationError as error:
        raise APIError(str(error), status_code=401, code=error.code) from None
