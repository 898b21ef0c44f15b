"""Clients that go away are ordinary: a real server logs no ERROR and no traceback when a client disconnects
before the first token, in the middle of a stream, while waiting for a whole response, or half-way through
sending its body; and the requests it abandoned are aborted (the server goes back to idle)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from http_fixtures import shared_server

pytestmark = pytest.mark.timeout(300)

# A prompt whose prefill takes several steps (chunks of 512 tokens on the CPU), so a client that leaves at once
# is gone before the first token.
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 300


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _request(server, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    auth = server.headers().get("Authorization", "")
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: {auth}\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def _send_and_leave(server, data: bytes, read_bytes: int = 0) -> None:
    """Send `data`, optionally read until `read_bytes` bytes of the response arrived, then close at once."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(data)
        received = b""
        while len(received) < read_bytes:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST


def test_disconnects_are_not_logged_as_errors(server):
    start = len(server.log_text())
    long_stream = {"stream": True, "max_tokens": 64}
    cases = [
        # Before the first token (the response has not started), on each generation route.
        (_request(server, "/generate", {"text": LONG_TEXT, "stream": True,
                                        "sampling_params": {"max_new_tokens": 64}}), 0),
        (_request(server, "/v1/completions", {"prompt": LONG_TEXT, **long_stream}), 0),
        (_request(server, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": LONG_TEXT}], **long_stream}), 0),
        # Mid-stream: after the first events.
        (_request(server, "/generate", {"text": "Count to a hundred:", "stream": True,
                                        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}), 600),
        # A non-streaming request left while it runs.
        (_request(server, "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 64}), 0),
        # Half-way through sending the body.
        (_request(server, "/generate", {"text": LONG_TEXT})[:-100], 0),
    ]
    for data, read_bytes in cases:
        _send_and_leave(server, data, read_bytes)
        time.sleep(0.3)
    server.wait_idle(timeout=60.0)
    time.sleep(0.5)  # let the last log lines reach the file
    log = server.log_text()[start:]
    assert "Traceback" not in log and "ERROR" not in log, log[-6000:]
    assert server.process.poll() is None
