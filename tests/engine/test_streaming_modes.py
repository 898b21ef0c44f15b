"""SGLang's two streaming modes of the native API, read the way SGLang's own clients read them.

Default (SGLang's): each chunk of `Engine.generate(stream=True)` and of `/generate` SSE holds the whole text,
output_ids and output logprobs so far; a reader takes `chunk["text"][offset:]`. With
`--incremental-streaming-output` each chunk holds only what is new, and the pieces concatenate to the
non-streamed result. `/get_server_info` reports the mode at its top level, to the administrator and to a tenant.
Real processes on the embedded model (CPU).
"""

from __future__ import annotations

import json

import httpx
import pytest

from http_fixtures import ADMIN_KEY, KEY_A, ServerProcess, shared_server
from radixserve import Engine

PARAMS = {"max_new_tokens": 10, "temperature": 0.0}
PROMPT = "The three primary colors are"


def _sse_chunks(url: str, body: dict, headers: dict) -> list[dict]:
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, headers=headers,
                      timeout=120.0) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _read_sglang_way(chunks: list[dict]) -> str:
    """SGLang's readers: print what follows the previous chunk's text."""
    text, offset = "", 0
    for chunk in chunks:
        text += chunk["text"][offset:]
        offset = len(chunk["text"])
    return text


def test_native_sse_default_sends_the_whole_output_so_far():
    server = shared_server()
    headers = server.headers()
    body = {"text": PROMPT, "sampling_params": PARAMS, "return_logprob": True}
    whole = httpx.post(server.url + "/generate", json=body, headers=headers, timeout=120.0).json()
    chunks = _sse_chunks(server.url, body, headers)
    assert len(chunks) >= 2
    assert _read_sglang_way(chunks) == whole["text"]
    for before, chunk in zip(chunks, chunks[1:]):
        assert chunk["text"].startswith(before["text"])
        assert chunk["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(chunk["output_ids"]) == meta["completion_tokens"]
        assert [entry[1] for entry in meta["output_token_logprobs"]] == chunk["output_ids"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for key in (KEY_A, ADMIN_KEY):
        info = httpx.get(server.url + "/get_server_info", headers=server.headers(key), timeout=30.0).json()
        assert info["incremental_streaming_output"] is False
        assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
    admin_state = server.server_info()["internal_states"][0]
    assert admin_state["last_gen_throughput"] >= 0.0 and "avg_spec_accept_length" not in admin_state


def test_openai_streams_stay_deltas_on_a_default_server():
    server = shared_server()
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0}
    whole = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=120.0).json()
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=server.headers(), timeout=120.0) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert "".join(pieces) == whole["choices"][0]["text"]


def test_engine_incremental_streaming_output_sends_only_new_output():
    with Engine(log_level="warning", incremental_streaming_output=True) as engine:
        whole = engine.generate(PROMPT, PARAMS, return_logprob=True)
        chunks = list(engine.generate(PROMPT, PARAMS, return_logprob=True, stream=True))
        assert len(chunks) >= 2
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        for chunk in chunks:
            assert [e[1] for e in chunk["meta_info"]["output_token_logprobs"]] == chunk["output_ids"]
        assert engine.server_args.incremental_streaming_output is True


@pytest.mark.slow
def test_server_flag_incremental_streaming_output():
    server = ServerProcess("--incremental-streaming-output", "--log-level", "warning")
    try:
        body = {"text": PROMPT, "sampling_params": PARAMS}
        whole = httpx.post(server.url + "/generate", json=body, timeout=120.0).json()
        chunks = _sse_chunks(server.url, body, {})
        assert len(chunks) >= 2 and "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        info = httpx.get(server.url + "/get_server_info", timeout=30.0).json()
        assert info["incremental_streaming_output"] is True
    finally:
        assert server.stop() == 0
