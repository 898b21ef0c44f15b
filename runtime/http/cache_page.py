"""See the cache: `GET /cache/tree` (a JSON summary of the caller's part of the radix tree) and `GET /cache`
(a page that draws it, shipped in runtime/http/static/ as package data: no build step, nothing from a CDN).

    GET /cache/tree?namespace=NAME&depth=D&max_nodes=N&detail=summary|text&rid=RID

Tenant isolation is `/get_server_info`'s: with a tenants file, the caller's API key decides its tenant and the
summary holds that tenant's namespaces only (`tenant:<id>` and its salted `tenant:<id>/salt:<s>`); with one
`--api-key` or none, the caller sees every namespace, as all requests share the default tenant. Other
namespaces are never read by the scheduler for this request, so their names, sizes and tokens cannot leak.
`detail=text` adds each node's text (the caller's own namespaces only, by the rule above). `rid` marks the
path of a running or recently finished request of the caller's namespaces; any other rid marks nothing.

The page and its two assets are open (they hold no data); the page sends the key the user enters with every
API call it makes (`/cache/tree`, `/get_server_info`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import msgspec
from fastapi import APIRouter, Depends, Query
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.wire.cache_tree import MAX_SUMMARY_DEPTH, MAX_SUMMARY_NODES, CacheTreeSummary
from radixserve.runtime.http.generation import json_response
from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.state import ServerState, caller_tenant
from radixserve.runtime.http.errors import APIError, bad_request
from radixserve.runtime.http.static_files import static_text
from radixserve.tokenizer_manager.io import make_namespace
from radixserve.tokenizer_manager.manager import engine_rid

MAX_TEXT_TOKENS = 256  # per node with detail=text: the start of a long node is enough to recognise it
ASSETS = {"cache.js": "text/javascript", "cache.css": "text/css"}

tenant_routes = access_router(Access.TENANT)
public_routes = access_router(Access.PUBLIC)  # the page and its assets: static files, no data


@tenant_routes.get("/cache/tree")
async def cache_tree(
    request: Request,
    tenant: Optional[str] = Depends(caller_tenant),
    namespace: Annotated[Optional[str], Query(min_length=1, max_length=1024)] = None,
    depth: Annotated[int, Query(ge=0, le=MAX_SUMMARY_DEPTH)] = 0,
    max_nodes: Annotated[int, Query(ge=1, le=MAX_SUMMARY_NODES)] = 200,
    detail: Literal["summary", "text"] = "summary",
    rid: Annotated[Optional[str], Query(min_length=1, max_length=256)] = None,
) -> Response:
    state: ServerState = request.app.state.server
    try:
        summary = await state.engine.async_get_cache_tree(
            namespace_prefix=make_namespace(tenant, None), namespace=namespace, max_depth=depth,
            max_nodes=max_nodes, with_token_ids=detail == "text",
            rid=None if rid is None else engine_rid(tenant, rid))  # rids are per tenant inside the engine
    except ValueError as error:
        raise bad_request(str(error)) from None
    out = summary_json(summary, state.tokenizer if detail == "text" else None)
    if out.get("path") is not None:
        out["path"]["rid"] = rid  # the caller's own id, not the engine's tenant-scoped one
    return json_response(out)


def summary_json(summary: CacheTreeSummary, tokenizer: Any = None) -> dict[str, Any]:
    """The summary as JSON-ready builtins; with a tokenizer, each node's token ids become its `text` (the start
    of it, `text_truncated` when cut), and the ids themselves are dropped."""
    out = msgspec.to_builtins(summary)
    for tree in out["namespaces"]:
        for node in tree["nodes"]:
            token_ids = node.pop("token_ids", None)
            if tokenizer is not None and token_ids is not None:
                node["text"] = tokenizer.decode(token_ids[:MAX_TEXT_TOKENS])
                node["text_truncated"] = len(token_ids) > MAX_TEXT_TOKENS
    return out


@public_routes.get("/cache")
async def cache_page() -> Response:
    return Response(static_text("cache.html"), media_type="text/html; charset=utf-8")


@public_routes.get("/cache/{asset}")
async def cache_asset(asset: str) -> Response:
    if asset not in ASSETS:
        raise APIError("Not found: no such route.", status_code=404, code="not_found")
    return Response(static_text(asset), media_type=f"{ASSETS[asset]}; charset=utf-8")


router = APIRouter()
router.include_router(tenant_routes)  # /cache/tree first: /cache/{asset} would match it too
router.include_router(public_routes)
