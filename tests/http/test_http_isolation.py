"""Tenants over a real server: the API key decides the cache namespace, and nothing a client sends can reach
another tenant's cached prefix or requests; `cache_salt` only splits the caller's own namespace."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from http_fixtures import KEY_A, KEY_B, shared_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _long_prompt() -> str:
    """A fresh ~150-token prompt nobody has cached yet."""
    tag = uuid.uuid4().hex
    return f"Record {tag}. " + " ".join(f"item {i} is {tag[i % 32]}" for i in range(25))


def _cached(server, key: str, prompt: str, salt: str | None = None) -> tuple[int, int]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60.0,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def test_tenants_never_share_cached_prefixes(server):
    prompt = _long_prompt()
    cached, prompt_tokens = _cached(server, KEY_A, prompt)
    assert cached == 0 and prompt_tokens > 100
    hit, _ = _cached(server, KEY_A, prompt)
    assert hit >= prompt_tokens - 2  # the whole prompt but the last token(s), which must be recomputed
    # Tenant B, whatever salt it sends (none, A's tenant id, strings that look like namespace parts), gets
    # nothing of A's. ("" is the same as no salt.)
    for salt in ("", "alpha", "tenant:alpha", "default"):
        assert _cached(server, KEY_B, prompt, salt)[0] == 0, salt
    # A salt splits A's own namespace.
    assert _cached(server, KEY_A, prompt, "s1")[0] == 0
    assert _cached(server, KEY_A, prompt, "s2")[0] == 0
    assert _cached(server, KEY_A, prompt, "s1")[0] >= prompt_tokens - 2
    # A still hits its own unsalted prefix; B now hits the copy it made for itself.
    assert _cached(server, KEY_A, prompt)[0] >= prompt_tokens - 2
    assert _cached(server, KEY_B, prompt)[0] >= prompt_tokens - 2
    # Server info shows each tenant only its own namespaces.
    for key, tenant in ((KEY_A, "alpha"), (KEY_B, "beta")):
        info = httpx.get(server.url + "/get_server_info", headers=server.headers(key)).json()
        names = set(info["cache"]["namespaces"])
        assert f"tenant:{tenant}" in names and all(n.startswith(f"tenant:{tenant}") for n in names), names


def test_a_tenant_cannot_abort_another_tenants_request(server):
    rid = f"a-{uuid.uuid4().hex}"
    result: dict = {}

    def run() -> None:
        result["response"] = httpx.post(server.url + "/generate", timeout=120.0, headers=server.headers(KEY_A), json={
            "text": "Count slowly:", "rid": rid, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}})

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for _ in range(200):
            if server.server_info()["num_running_reqs"] >= 1:
                break
        stranger = httpx.post(server.url + "/abort_request", json={"rid": rid}, headers=server.headers(KEY_B))
        assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "request_not_found"
        owner = httpx.post(server.url + "/abort_request", json={"rid": rid}, headers=server.headers(KEY_A))
        assert owner.status_code == 200
    finally:
        thread.join(60.0)
    meta = result["response"].json()["meta_info"]
    assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 600
    server.wait_idle()


def test_keys_guard_every_route_but_health(server):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/generate"), ("GET", "/get_server_info"), ("GET", "/get_model_info"),
                         ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/health_generate"),
                         ("GET", "/metrics")):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY_A}):
            response = httpx.request(method, server.url + path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics", headers=server.headers(server.admin_key))
    assert metrics.status_code == 200 and "radixserve:num_running_reqs{" in metrics.text
