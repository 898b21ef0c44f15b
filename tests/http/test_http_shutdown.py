"""The CLI and the server's lifecycle: `radixserve generate` prints the same greedy text the server serves,
and SIGTERM drains in-flight requests, aborts what outlives the drain, exits 0 and leaves no process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from http_fixtures import shared_server, take_shared_server

pytestmark = pytest.mark.timeout(300)
DRAIN_SECONDS = 4.0  # the shared server's --graceful-shutdown-timeout


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_cli_generate_prints_the_greedy_completion(server):
    prompt = "Name a fruit."
    served = httpx.post(server.url + "/v1/chat/completions", timeout=60.0, headers=server.headers(), json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}).json()
    printed = subprocess.run([sys.executable, "-m", "radixserve", "generate", prompt, "--max-new-tokens", "8",
                              "--log-level", "warning"], capture_output=True, text=True, timeout=240)
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert printed.stdout == served["choices"][0]["message"]["content"] + "\n"


def _stream(server, max_tokens: int, out: dict) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120.0,
                      headers=server.headers()) as response:
        out["events"] = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    out["ended"] = time.monotonic()


def test_sigterm_drains_aborts_the_rest_and_exits_zero():
    server = take_shared_server()
    try:
        _check_graceful_shutdown(server)
    finally:
        server.stop()


def _check_graceful_shutdown(server) -> None:
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert len(children) >= 2  # the scheduler and the detokenizer
    short, long = {}, {}
    # The short request must still be running when the long one starts: 48 tokens take a few hundred ms on two cores.
    threads = [threading.Thread(target=_stream, args=(server, 48, short)),
               threading.Thread(target=_stream, args=(server, 5000, long))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while server.server_info()["num_running_reqs"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    refused = False
    while time.monotonic() - signalled < DRAIN_SECONDS:  # no new connections once the signal is in
        try:
            httpx.get(server.url + "/health", timeout=0.5)
        except httpx.TransportError:
            refused = True
            break
        time.sleep(0.1)
    assert refused
    for thread in threads:
        thread.join(60)
    assert server.process.wait(60) == 0

    def finish_reasons(events: list[str]) -> list[str]:
        return [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]

    assert short["events"][-1] == "[DONE]" and finish_reasons(short["events"]) == ["length"]
    assert long["events"][-1] == "[DONE]" and finish_reasons(long["events"]) == ["abort"]
    assert DRAIN_SECONDS - 0.5 <= long["ended"] - signalled < DRAIN_SECONDS + 10
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
