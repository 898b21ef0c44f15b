"""Fair share and priority over HTTP: a real server with a weighted tenants file, a real HTTP client.

Tenant A floods the server with 20 concurrent requests (two run at a time); tenant B's one request, sent once A's
are queued, finishes long before A's queue drains. The tenants file's weights reach the scheduler; `priority`
is SGLang's field on /generate and the OpenAI routes.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import httpx
import pytest

from http_fixtures import ServerProcess
from radixserve.runtime.tenancy import load_tenants

pytestmark = [pytest.mark.timeout(600)]
KEY_A, KEY_B, ADMIN = "sk-flood", "sk-light", "sk-admin-fair"


def write_tenants(entries: dict) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="radixserve-fair-"), "tenants.json")
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


@pytest.fixture(scope="module")
def server():
    path = write_tenants({KEY_A: {"tenant": "flood", "weight": 1}, KEY_B: {"tenant": "light", "weight": 3}})
    process = ServerProcess("--tenants-file", path, "--admin-api-key", ADMIN, "--max-running-requests", "2",
                            "--enable-priority-scheduling", "--log-level", "warning", admin_key=ADMIN)
    yield process
    process.stop()


def generate(server, key: str, text: str, max_new_tokens: int = 16, **fields) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                              "ignore_eos": True}, **fields}
    return httpx.post(server.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300.0)


@pytest.mark.slow
def test_a_flooding_tenant_does_not_delay_a_light_one(server):
    finished: list[str] = []
    lock = threading.Lock()

    def flood(i: int) -> None:
        response = generate(server, KEY_A, f"Flood request number {i}: tell a long story about the sea.")
        assert response.status_code == 200, response.text
        with lock:
            finished.append(f"a{i}")

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while server.server_info()["num_queued_reqs"] < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    response = generate(server, KEY_B, "A light tenant's single question: what is the capital of France?")
    assert response.status_code == 200, response.text
    with lock:
        finished_before_b = len(finished)
    for thread in threads:
        thread.join()
    assert len(finished) == 20
    assert finished_before_b <= 6, finished_before_b  # first come, first served would put b behind ~18 of a's
    tenants = server.wait_idle(60)["fair_share"]["tenants"]
    assert tenants["flood"]["weight"] == 1.0 and tenants["light"]["weight"] == 3.0
    assert tenants["flood"]["tokens_computed"] > 10 * tenants["light"]["tokens_computed"] > 0


@pytest.mark.slow
def test_priority_is_accepted_on_every_route_and_checked(server):
    assert generate(server, KEY_B, "Hello", 2, priority=7).status_code == 200
    assert generate(server, KEY_B, "Hello", 2, priority=None).status_code == 200
    headers = {"Authorization": f"Bearer {KEY_B}"}
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        ok = httpx.post(server.url + path, json={**body, "max_tokens": 2, "priority": -3}, headers=headers,
                        timeout=120.0)
        assert ok.status_code == 200, ok.text
        bad = httpx.post(server.url + path, json={**body, "max_tokens": 2, "priority": "high"}, headers=headers,
                         timeout=120.0)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    bad = generate(server, KEY_B, "Hello", 2, priority=1.5)
    assert bad.status_code == 400 and "priority" in bad.text


def test_tenants_file_weights_are_checked():
    tenants, weights = load_tenants(write_tenants({"k1": "plain", "k2": {"tenant": "heavy", "weight": 2.5},
                                                   "k3": {"tenant": "heavy", "weight": 2.5}}))
    assert tenants == {"k1": "plain", "k2": "heavy", "k3": "heavy"} and weights == {"plain": 1.0, "heavy": 2.5}
    for bad in ({"k": {"tenant": "t", "weight": 0}}, {"k": {"tenant": "t", "weight": "2"}},
                {"k": {"tenant": "t", "wieght": 2}}, {"k1": {"tenant": "t", "weight": 2}, "k2": "t"},
                {"k": {"weight": 2}}):
        with pytest.raises(ValueError):
            load_tenants(write_tenants(bad))
