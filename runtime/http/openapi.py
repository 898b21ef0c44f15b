"""The OpenAPI schema served at `GET /openapi.json`.

FastAPI generates the paths from the routes, but the POST routes read their raw body and validate it with a
pydantic model themselves (`parse_request`: one error envelope, strict JSON), so FastAPI does not see those
bodies. `install_openapi` completes the generated schema: each POST route's `requestBody` references its
model's JSON schema under `components/schemas`, every operation lists the error envelope as its 4XX/5XX answer
(FastAPI's default 422 is never sent: validation errors are 400s), and the routes that need the API key say so
with a bearer security scheme.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from radixserve.runtime.http.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixserve.runtime.http.access import Access, served_routes
from radixserve.runtime.http.lora_api import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from radixserve.runtime.http.native_api import _RidBody as AbortRequest
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.runtime.http.pooling_api import ClassifyRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from radixserve.runtime.http.vllm_api import DetokenizeRequest, TokenizeRequest
from radixserve.runtime.http.openai.responses_protocol import ResponsesRequest
from radixserve.runtime.wire.request import SERVER_FIELDS, GenerateRequest

# POST path -> (schema name, the model its handler validates the body with: pydantic, or the wire's msgspec struct).
REQUEST_BODIES: dict[str, tuple[str, type[Any]]] = {
    "/v1/chat/completions": ("ChatCompletionRequest", ChatCompletionRequest),
    "/v1/completions": ("CompletionRequest", CompletionRequest),
    "/generate": ("GenerateRequest", GenerateRequest),
    "/abort_request": ("AbortRequest", AbortRequest),
    "/load_lora_adapter": ("LoadLoRAAdapterRequest", LoadLoRAAdapterRequest),
    "/unload_lora_adapter": ("UnloadLoRAAdapterRequest", UnloadLoRAAdapterRequest),
    "/v1/embeddings": ("EmbeddingRequest", EmbeddingRequest),
    "/v1/rerank": ("RerankRequest", RerankRequest),
    "/rerank": ("RerankRequest", RerankRequest),
    "/v1/score": ("ScoreRequest", ScoreRequest),
    "/classify": ("ClassifyRequest", ClassifyRequest),
    "/v1/classify": ("ClassifyRequest", ClassifyRequest),
    "/tokenize": ("TokenizeRequest", TokenizeRequest),
    "/detokenize": ("DetokenizeRequest", DetokenizeRequest),
    "/v1/messages": ("MessagesRequest", MessagesRequest),
    "/v1/messages/count_tokens": ("CountTokensRequest", CountTokensRequest),
    "/v1/responses": ("ResponsesRequest", ResponsesRequest),
}
_REF = "#/components/schemas/{model}"
_ERROR = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}


def install_openapi(app: FastAPI, request_bodies: dict[str, tuple[str, type[Any]]] = REQUEST_BODIES) -> None:
    """Make `app.openapi()` (what /openapi.json serves) document `request_bodies` as well as the routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, request_bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, request_bodies: dict[str, tuple[str, type[Any]]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, which this server never sends
        schemas.pop(name, None)
    schemas["ErrorResponse"] = _ERROR
    components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, (name, model) in request_bodies.items():
        model_schema = _model_schema(model)
        schemas.update(model_schema.pop("$defs", {}))
        schemas[name] = model_schema
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": {"$ref": _REF.format(model=name)}}}}
    public = {route.path for route in served_routes(app) if route.access is Access.PUBLIC}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            _document_errors(operation, None if path in public else [{"apiKey": []}])
    return schema


def _model_schema(model: type[Any]) -> dict[str, Any]:
    """A body model's JSON schema, its definitions under "$defs"; a msgspec struct's without the fields only the
    server sets."""
    if issubclass(model, BaseModel):
        return model.model_json_schema(ref_template=_REF)
    (_, ), components = msgspec.json.schema_components((model,), ref_template=_REF.replace("{model}", "{name}"))
    schema = components.pop(model.__name__)
    for name in SERVER_FIELDS:
        schema["properties"].pop(name, None)
    return {**schema, "$defs": components}


def _document_errors(operation: dict[str, Any], security: Optional[list[dict[str, list]]]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    responses["4XX"] = {"description": "Invalid request (OpenAI error envelope)", **error}
    responses["5XX"] = {"description": "Server busy, shutting down or failed (OpenAI error envelope)", **error}
    if security is not None:
        operation["security"] = security
