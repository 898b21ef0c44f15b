"""Large bodies never freeze the server: tokenizing happens off the HTTP event loop (on the TokenizerManager's
worker), a text far beyond the context is refused by its length before it is tokenized, and bodies past
`--max-request-bytes` get a 413. Real server, real HTTP clients."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from http_fixtures import ServerProcess

LIMIT_BYTES = 24 * 1024 * 1024
HEALTH_BUDGET_S = 2.0  # before tokenizing moved off the event loop: ~20 s during a 20 MB prompt


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--log-level", "warning", "--max-request-bytes", str(LIMIT_BYTES))
    yield server
    server.stop()


def probe_health_while(server: ServerProcess, work) -> tuple[object, float]:
    """Run `work()` on a thread while polling /health; returns work's result and the slowest /health."""
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.02)
    thread.join()
    return result["value"], slowest


@pytest.mark.parametrize("route,body_of", [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/generate", lambda text: {"text": text, "sampling_params": {"max_new_tokens": 1}}),
])
def test_a_20mb_prompt_is_refused_without_stalling_health(server, route, body_of):
    text = "lorem ipsum dolor sit amet " * (20 * 1024 * 1024 // 27)
    response, slowest = probe_health_while(
        server, lambda: httpx.post(server.url + route, json=body_of(text), timeout=120))
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert slowest < HEALTH_BUDGET_S, f"/health took {slowest:.2f} s during the request"


def test_many_long_prompts_are_tokenized_off_the_event_loop(server):
    """Prompts just past the context, so each one is really tokenized before the length rule refuses it:
    /health stays fast while they are."""
    text = "The quick brown fox jumps over the lazy dog. " * 900  # ~9k tokens, just past the 8k context

    def many() -> list[httpx.Response]:
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda i=i: results.append(httpx.post(
            server.url + "/v1/completions", json={"prompt": f"{i} {text}", "max_tokens": 1}, timeout=300)))
            for i in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    responses, slowest = probe_health_while(server, many)
    assert len(responses) == 24
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" for r in responses)
    assert all("tokens" in r.json()["error"]["message"] for r in responses)
    assert slowest < HEALTH_BUDGET_S, f"/health took {slowest:.2f} s during the requests"


def test_bodies_past_the_limit_get_413(server):
    big = b'{"prompt": "' + b"x" * (LIMIT_BYTES + 10) + b'"}'
    declared = httpx.post(server.url + "/v1/completions", content=big, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMIT_BYTES // (1 << 20) + 2):
            yield b"x" * (1 << 20)
        yield b'"}'

    streamed = httpx.post(server.url + "/generate", content=chunks(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                      timeout=60).status_code == 200
