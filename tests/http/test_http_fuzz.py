"""Malformed and extreme bodies against every route of a real server: never a 5xx, never a crash, and a
normal request still works afterwards."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_fixtures import shared_server

pytestmark = pytest.mark.timeout(600)

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "temperature": 0},
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/abort_request": {"rid": "x"},
    "/flush_cache": {},
}
GET_ROUTES = ["/v1/models", "/health", "/health_generate", "/get_model_info", "/get_server_info", "/metrics"]
# Fields whose valid values set the amount of work; fuzzing them with mid-sized integers would only make
# the test slow, so they get everything but those.
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_new_tokens", "n", "min_tokens", "min_new_tokens",
                 "best_of", "top_logprobs", "logprobs", "top_logprobs_num"}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "user", "assistant", "text", "\u0000", "🙂" * 10, "x" * 5000, "-1", "1e309"]),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)
field_names = st.sampled_from(sorted({
    "messages", "prompt", "text", "input_ids", "sampling_params", "rid", "model", "temperature", "top_p", "stop",
    "stream", "stream_options", "logit_bias", "seed", "echo", "suffix", "user", "cache_salt", "top_k", "min_p",
    "response_format", "tools", "tool_choice", "return_logprob", "logprob_start_len", "unknown_field", "tenant",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "stop_token_ids",
}))
length_values = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=5),
                          st.integers(max_value=0), st.integers(min_value=10**6), st.lists(st.integers(), max_size=3))


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(ROUTES)))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "nested", "replace", "raw"]))
    body = json.loads(json.dumps(ROUTES[path]))
    if kind == "mutate":
        for _ in range(draw(st.integers(1, 3))):
            body[draw(field_names)] = draw(json_values)
        field = draw(st.sampled_from(sorted(LENGTH_FIELDS)))
        if draw(st.booleans()):
            body[field] = draw(length_values)
    elif kind == "nested":
        target = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else None
        if target is None and "messages" in body:
            target = body["messages"][0]
        if target is None:
            target = body
        target[draw(field_names)] = draw(json_values)
    elif kind == "replace":
        body = draw(json_values)
    if kind == "raw":
        payload = draw(st.one_of(st.binary(max_size=200), st.sampled_from([
            b"", b"{", b"null", b"[]", b'{"messages": NaN}', b'{"prompt": "a", "max_tokens": 1e999}',
            b'{"prompt": "\\ud800"}', b"\xff\xfe", b'{"a":' * 2000 + b"1" + b"}" * 2000])))
    else:
        payload = json.dumps(body, allow_nan=True).encode()
    return path, payload


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_fuzzed_bodies_never_cause_a_server_error(server):
    client = httpx.Client(base_url=server.url, headers={**server.headers(), "Content-Type": "application/json"},
                          timeout=120.0)
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=80, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests(), st.sampled_from(GET_ROUTES + ["/v1/models/%00", "/v1/models/a/b", "/nope", "/generate"]))
    def check(request, get_path):
        path, payload = request
        response = client.post(path, content=payload)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (path, payload[:300], response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        get = client.get(get_path)
        assert get.status_code < 500, (get_path, get.text[:300])

    check()
    # The examples reached both the validation and the generation paths.
    assert statuses[400] >= 20 and statuses[200] >= 3, statuses
    assert server.process.poll() is None
    server.wait_idle(timeout=10.0)
    ok = client.post("/v1/chat/completions", json=ROUTES["/v1/chat/completions"])
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
