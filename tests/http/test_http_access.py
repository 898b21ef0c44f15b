"""Every route has a class (public, tenant, admin), the class is what the route enforces, and docs/security.md lists
each one (runtime/http/access.py). The app is create_app's over a real Engine of the embedded model, with two
tenants and an administrator; requests go through Starlette's in-process client."""

from __future__ import annotations

import os
import re

import pytest
from starlette.responses import Response
from starlette.testclient import TestClient

from http_fixtures import ADMIN_KEY, KEY_A, shared_server, tenants_file
from radixserve.runtime.engine import Engine
from radixserve.runtime.http.access import (
    Access, UnclassifiedRouteError, access_router, check_route_classes, served_routes, unclassified_routes,
)
from radixserve.runtime.http.server import create_app
from radixserve.runtime.wire.server_args import ServerArgs

pytestmark = pytest.mark.timeout(300)
SECURITY_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "security.md")


@pytest.fixture(scope="module")
def app():
    with Engine(log_level="warning", max_running_requests=4) as engine:
        yield create_app(engine, ServerArgs(tenants_file=tenants_file(), admin_api_key=ADMIN_KEY))


def http_routes(app):
    """(method, path with its parameters filled, class) of every route of the app."""
    for route in served_routes(app):
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        for method in sorted(route.methods - {"HEAD"}):
            yield method, path, route.access


def test_every_route_declares_a_class(app):
    assert unclassified_routes(app) == []
    check_route_classes(app)
    classes = {route.path: route.access for route in served_routes(app)}
    assert classes["/health"] is Access.PUBLIC and classes["/openapi.json"] is Access.PUBLIC
    assert classes["/generate"] is Access.TENANT and classes["/v1/chat/completions"] is Access.TENANT
    for admin in ("/flush_cache", "/metrics", "/load_lora_adapter", "/unload_lora_adapter"):
        assert classes[admin] is Access.ADMIN, admin


def test_a_route_without_a_class_is_refused(app):
    async def debug() -> Response:
        return Response("state")

    app.add_api_route("/debug_state", debug, methods=["GET"])  # a bare registration: no class
    try:
        assert unclassified_routes(app) == ["GET /debug_state"]
        with pytest.raises(UnclassifiedRouteError, match="/debug_state"):
            check_route_classes(app)
    finally:
        app.router.routes.pop()
    classified = access_router(Access.ADMIN)
    classified.add_api_route("/debug_state", debug, methods=["GET"])
    app.include_router(classified)
    try:
        check_route_classes(app)
        assert TestClient(app).get("/debug_state", headers=bearer(KEY_A)).status_code == 403
        assert TestClient(app).get("/debug_state", headers=bearer(ADMIN_KEY)).text == "state"
    finally:
        app.router.routes.pop()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def _error_kind(response) -> str:
    """The error's code in the OpenAI envelope, or its type in Anthropic's (the /v1/messages routes answer in it)."""
    error = response.json()["error"]
    return error.get("code") or error["type"]


def test_each_class_is_enforced_before_the_route_runs(app):
    """No key: 401 on every tenant and admin route; a tenant's key: 403 on every admin route; public routes answer
    without a key. The refused requests carry bodies that would act (flush, load, generate) if they ran."""
    client = TestClient(app, raise_server_exceptions=False)
    acting_body = {"text": "hi", "lora_name": "a", "lora_path": "/", "rid": "x"}
    checked = 0
    for method, path, access in http_routes(app):
        anonymous = client.request(method, path, json=acting_body)
        wrong = client.request(method, path, json=acting_body, headers=bearer("sk-wrong"))
        tenant = client.request(method, path, json=acting_body, headers=bearer(KEY_A))
        if access is Access.PUBLIC:
            assert anonymous.status_code not in (401, 403), (method, path)
            continue
        assert anonymous.status_code == 401, (method, path, anonymous.text)
        assert wrong.status_code == 401 and _error_kind(wrong) in ("invalid_api_key", "authentication_error"), (
            method, path)
        if access is Access.ADMIN:
            assert tenant.status_code == 403 and _error_kind(tenant) == "admin_required", (method, path)
        else:
            assert tenant.status_code not in (401, 403), (method, path, tenant.text)
        checked += 1
    assert checked >= 15


def test_the_threat_model_lists_every_route_with_its_class(app):
    with open(SECURITY_DOC, encoding="utf-8") as f:
        rows = re.findall(r"^\| `([A-Z,]+) (/[^`]*)` \| (public|tenant|admin) \|", f.read(), flags=re.M)
    documented = {(method, path): access for methods, path, access in rows for method in methods.split(",")}
    for route in served_routes(app):
        for method in sorted(route.methods - {"HEAD"}):
            assert documented.get((method, route.path)) == getattr(route.access, "value", None), (method, route.path)


def test_a_two_megabyte_header_is_refused_and_the_server_stays_fast():
    """The real server (uvicorn, httptools): a head past --max-header-bytes (64 KiB) is a 431, whatever the route."""
    import httpx

    server = shared_server()
    for path in ("/health", "/generate"):
        refused = httpx.get(server.url + path, headers={"X-Padding": "a" * (2 << 20)}, timeout=30.0)
        assert refused.status_code == 431 and refused.json()["error"]["code"] == "headers_too_large", path
    many = {f"X-Pad-{i}": "b" * 1000 for i in range(100)}
    assert httpx.get(server.url + "/health", headers=many, timeout=30.0).status_code == 431
    assert httpx.get(server.url + "/health", headers={"X-Small": "c" * 1000}, timeout=5.0).status_code == 200
