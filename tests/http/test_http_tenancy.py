"""Tenants see nothing of each other, and only the administrator acts on every tenant. Real server (tenants A and B
and an admin key), real HTTP client.

- `/get_server_info`: a tenant sees the model's facts and its own namespaces and requests, never the server's
  traffic (request counts, running requests, memory in use, throughput) or another tenant's namespaces;
- salts are never listed, to anyone: namespaces name them by a digest;
- `/flush_cache` and `/metrics` need the admin key (403 for a tenant);
- rids are per tenant: B may use the rid A's running request has, and aborting it touches only B's own;
- admission has default limits: one request may hold at most 1024 sequences (prompts x n).
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from http_fixtures import ADMIN_KEY, KEY_A, KEY_B, shared_server
from radixserve.runtime.wire.server_args import DEFAULT_MAX_QUEUED_REQUESTS, ServerArgs

pytestmark = pytest.mark.timeout(300)
TRAFFIC_KEYS = ("num_requests", "num_finished", "num_running_reqs", "num_queued_reqs", "memory", "token_usage",
                "gen_throughput", "generated_tokens", "prefill_tokens_computed", "decode_steps")


@pytest.fixture(scope="module")
def server():
    return shared_server()


def get(server, path: str, key: str) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60.0)


def post(server, path: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120.0)


def test_a_tenant_sees_only_its_own_part_of_the_server_and_no_salt(server):
    salt = f"secret-salt-{uuid.uuid4().hex}"
    body = {"prompt": f"Tenant A's private prompt {uuid.uuid4().hex}", "max_tokens": 2, "temperature": 0,
            "cache_salt": salt}
    assert post(server, "/v1/completions", KEY_A, body).status_code == 200
    assert post(server, "/v1/completions", KEY_B, {**body, "cache_salt": None}).status_code == 200

    own = get(server, "/get_server_info", KEY_A)
    assert own.status_code == 200
    info = own.json()
    for key in TRAFFIC_KEYS:
        assert key not in info, key
    assert info["context_len"] > 0 and info["max_total_num_tokens"] > 0  # the model's facts stay visible
    names = set(info["cache"]["namespaces"])
    assert names and all(name.startswith("tenant:alpha") for name in names), names
    assert set(info["http"]) == {"served_model_name", "inflight_engine_requests"}

    everything = get(server, "/get_server_info", ADMIN_KEY).json()
    for key in TRAFFIC_KEYS:
        assert key in everything, key
    assert any(name.startswith("tenant:beta") for name in everything["cache"]["namespaces"])
    for text in (own.text, get(server, "/get_server_info", ADMIN_KEY).text):
        assert salt not in text, "a salt must never be listed"
    assert any("/salt#" in name for name in names)


def test_flush_and_metrics_need_the_admin_key(server):
    for key in (KEY_A, KEY_B):
        refused = post(server, "/flush_cache", key, {})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
        assert "running" not in refused.text  # a refusal must not reveal another tenant's activity
        assert get(server, "/metrics", key).status_code == 403
    server.wait_idle()
    assert post(server, "/flush_cache", ADMIN_KEY, {}).status_code == 200
    assert get(server, "/metrics", ADMIN_KEY).status_code == 200


def test_rids_are_per_tenant(server):
    rid = f"shared-{uuid.uuid4().hex}"
    result: dict = {}

    def run_a() -> None:
        result["a"] = post(server, "/generate", KEY_A, {
            "text": "Count slowly:", "rid": rid, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}})

    thread = threading.Thread(target=run_a)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while server.server_info()["num_running_reqs"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # B uses the same rid: accepted, as if A did not exist, and its answer carries B's own rid.
        b = post(server, "/generate", KEY_B, {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 2}})
        assert b.status_code == 200, b.text
        assert b.json()["meta_info"]["id"] == rid
        # B's abort of that rid finds nothing of B's running: A's request goes on.
        assert post(server, "/abort_request", KEY_B, {"rid": rid}).status_code == 404
        assert server.server_info()["num_running_reqs"] >= 1
        assert post(server, "/abort_request", KEY_A, {"rid": rid}).status_code == 200
    finally:
        thread.join(60.0)
    meta = result["a"].json()["meta_info"]
    assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort"
    server.wait_idle()


def test_default_admission_limits(server):
    # 256 prompts x n=16: refused at once, whatever the queue.
    huge = post(server, "/generate", KEY_A, {"text": ["hi"] * 256, "sampling_params": {"max_new_tokens": 1, "n": 16}})
    assert huge.status_code == 400 and "sequences" in huge.json()["error"]["message"]
    args = ServerArgs()
    assert args.resolved_max_queued_requests() == DEFAULT_MAX_QUEUED_REQUESTS and args.max_sequences_per_request
    server.wait_idle()
