"""A dead child ends the whole server: pending requests fail at once with a 503 (no traceback in the body), the
other child stops, and the server exits non-zero so a supervisor restarts it. Real server, real processes."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from http_fixtures import ServerProcess

EXIT_DEADLINE_S = 15.0
STREAM_END_DEADLINE_S = 10.0  # the pending stream's end after the kill (seconds, even on a loaded 2-core machine)


def children_by_role(server: ServerProcess) -> dict[str, psutil.Process]:
    """The scheduler and detokenizer processes (started in that order), without multiprocessing's tracker."""
    kids = [p for p in psutil.Process(server.process.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]
    kids.sort(key=lambda p: p.create_time())
    assert len(kids) == 2, kids
    return {"scheduler": kids[0], "detokenizer": kids[1]}


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_a_dead_child_fails_pending_requests_and_ends_the_server(victim):
    server = ServerProcess("--log-level", "warning")
    try:
        children = children_by_role(server)
        outcome: dict[str, object] = {}
        streaming = threading.Event()

        def long_stream() -> None:
            body = {"text": "Tell me a long story.", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            lines = []
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        streaming.set()
            outcome["lines"], outcome["ended"] = lines, time.monotonic()

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert streaming.wait(60), "the stream never started"
        killed = time.monotonic()
        children[victim].kill()

        reader.join(timeout=STREAM_END_DEADLINE_S)
        assert not reader.is_alive(), "the pending stream did not end"
        assert outcome["ended"] - killed < STREAM_END_DEADLINE_S
        last_events = outcome["lines"][-2:]
        assert last_events[-1] == "data: [DONE]" and "engine_unavailable" in last_events[0]
        assert "Traceback" not in "".join(outcome["lines"])

        code = server.process.wait(timeout=EXIT_DEADLINE_S)
        exited = time.monotonic() - killed
        assert code != 0, "a server whose child died must exit non-zero"
        assert exited < EXIT_DEADLINE_S
        for process in children.values():
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()


def test_a_dead_engine_answers_503_without_internals():
    """Between a child's death and the exit, every route answers 503 (server info included), never a 500."""
    server = ServerProcess("--log-level", "warning", "--graceful-shutdown-timeout", "30")
    try:
        children_by_role(server)["detokenizer"].kill()
        statuses = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and server.process.poll() is None:
            try:
                for method, path, body in (("GET", "/get_server_info", None), ("GET", "/health", None),
                                           ("POST", "/generate", {"text": "hi"})):
                    response = httpx.request(method, server.url + path, json=body, timeout=5)
                    if response.status_code != 200:
                        statuses.add(response.status_code)
                        assert "Traceback" not in response.text
            except httpx.TransportError:
                break  # the server already exited
        assert statuses <= {503}, statuses
        assert server.process.wait(timeout=EXIT_DEADLINE_S) != 0
    finally:
        server.stop()
