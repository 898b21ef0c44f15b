"""A /flush_cache refused because requests are running says when to try again (`Retry-After`), like every other
refusal that a retry can fix; once the server is idle the same call succeeds."""

from __future__ import annotations

import threading

import httpx
import pytest

from http_fixtures import shared_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_a_refused_flush_has_retry_after(server):
    server.wait_idle()
    started = threading.Event()

    def long_stream() -> None:
        body = {"text": "Count:", "stream": True, "rid": "flush-blocker",
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers(),
                          timeout=120.0) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert started.wait(60)
        refused = httpx.post(server.url + "/flush_cache", headers=server.headers(server.admin_key), timeout=30.0)
        assert refused.status_code == 400
        assert int(refused.headers["Retry-After"]) >= 1
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        httpx.post(server.url + "/abort_request", json={"rid": "flush-blocker"}, headers=server.headers(),
                   timeout=30.0)
        thread.join(60)
    server.wait_idle()
    assert httpx.post(server.url + "/flush_cache", headers=server.headers(server.admin_key), timeout=30.0).status_code == 200
