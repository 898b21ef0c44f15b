"""The native routes over a real server: /generate (single, batch, SSE), the RPC routes and metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from http_fixtures import shared_server

pytestmark = pytest.mark.timeout(300)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120.0)


def _admin_post(server, path: str) -> httpx.Response:
    return httpx.post(server.url + path, json={}, headers=server.headers(server.admin_key), timeout=120.0)


def test_generate_single_batch_and_stream_agree(server):
    params = {"max_new_tokens": 8, "temperature": 0}
    single = _post(server, "/generate", {"text": PROMPT, "sampling_params": params}).json()
    assert single["text"] and len(single["output_ids"]) == single["meta_info"]["completion_tokens"]
    assert single["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    batch = _post(server, "/generate", {"text": [PROMPT, "Hello"], "sampling_params": params}).json()
    assert isinstance(batch, list) and batch[0]["text"] == single["text"]
    by_ids = _post(server, "/generate", {"input_ids": [single["output_ids"], single["output_ids"][:3]],
                                         "sampling_params": [params, params]}).json()
    assert len(by_ids) == 2 and by_ids[0]["meta_info"]["prompt_tokens"] == len(single["output_ids"])

    with httpx.stream("POST", server.url + "/generate", headers=server.headers(), timeout=120.0,
                      json={"text": PROMPT, "sampling_params": params, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # SGLang's default: each chunk holds the whole text so far; a reader takes chunk["text"][offset:].
    read = ""
    for chunk in chunks:
        assert chunk["text"].startswith(read)
        read += chunk["text"][len(read):]
    assert read == single["text"] and chunks[-1]["output_ids"] == single["output_ids"]
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks].count(True) == 1


def test_generate_logprobs_and_n(server):
    result = _post(server, "/generate", {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                         "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    meta = result["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == result["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    samples = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 2,
                                                                               "seed": 3}}).json()
    assert isinstance(samples, list) and len(samples) == 2


@pytest.mark.parametrize("body,param", [
    ({"sampling_params": {"max_new_tokens": 2}}, None),
    ({"text": "a", "input_ids": [1]}, None),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"unknown": 1}}, "sampling_params.unknown"),
    ({"text": "a", "tenant": "beta"}, "tenant"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}, "input_ids"),
    ({"text": ["a", "b"], "rid": "same"}, None),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
])
def test_generate_rejects_bad_requests_with_400(server, body, param):
    response = _post(server, "/generate", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_context_length_error_code_for_text_prompts(server):
    response = _post(server, "/generate", {"text": "word " * 12000, "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_rpc_routes(server):
    model_info = httpx.get(server.url + "/get_model_info", headers=server.headers()).json()
    assert model_info["served_model_name"] == "SmolLM2-135M-Instruct" and model_info["context_length"] > 0
    info = server.wait_idle()
    for key in ("memory", "cache", "num_running_reqs", "num_queued_reqs", "token_usage", "max_total_num_tokens"):
        assert key in info
    assert httpx.get(server.url + "/health_generate", headers=server.headers(), timeout=60.0).status_code == 200
    assert _admin_post(server, "/flush_cache").status_code == 200
    prompt = "Flushed caches forget " * 20
    _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})
    again = _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] > 0
    server.wait_idle()
    assert _admin_post(server, "/flush_cache").status_code == 200
    after = _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert after["meta_info"]["cached_tokens"] == 0
    assert _post(server, "/abort_request", {"rid": "not-running"}).status_code == 404


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


# SGLang's metric names (python/sglang/srt/metrics/collector.py) after the prefix: a dashboard written for SGLang
# works after renaming `sglang:` to `radixserve:`.
SGLANG_NAMES = ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total", "num_requests_total",
                "num_aborted_requests_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds", "num_running_reqs", "num_queue_reqs", "num_used_tokens",
                "max_total_num_tokens", "token_usage", "cache_hit_rate", "gen_throughput")


def test_metrics_count_requests(server):
    before = httpx.get(server.url + "/metrics", headers=server.headers(server.admin_key)).text
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    result = _post(server, "/generate", {"text": PROMPT, "sampling_params": params}).json()
    with httpx.stream("POST", server.url + "/generate", headers=server.headers(), timeout=120.0,
                      json={"text": PROMPT, "sampling_params": params, "stream": True}) as response:
        assert sum(1 for line in response.iter_lines() if line.startswith("data: ")) >= 3
    after = httpx.get(server.url + "/metrics", headers=server.headers(server.admin_key)).text
    for name, delta in (("radixserve:generation_tokens_total", 6),
                        ("radixserve:prompt_tokens_total", 2 * result["meta_info"]["prompt_tokens"]),
                        ("radixserve:time_to_first_token_seconds_count", 2),
                        ("radixserve:e2e_request_latency_seconds_count", 2),
                        ("radixserve:num_requests_total", 2),
                        ("radixserve:num_aborted_requests_total", 0)):
        assert _metric(after, name) - _metric(before, name) == delta, name
    # The streamed request's three tokens arrived in separate chunks: two gaps.
    assert _metric(after, "radixserve:inter_token_latency_seconds_count") - _metric(
        before, "radixserve:inter_token_latency_seconds_count") >= 2
    assert _metric(after, "radixserve:max_total_num_tokens") == server.server_info()["max_total_num_tokens"]


def test_metrics_have_sglang_names_and_a_model_name_label(server):
    model = httpx.get(server.url + "/v1/models", headers=server.headers()).json()["data"][0]["id"]
    families = {family.name: family for family in text_string_to_metric_families(
        httpx.get(server.url + "/metrics", headers=server.headers(server.admin_key)).text)}
    for name in SGLANG_NAMES:
        # The parser names a counter family without its `_total` suffix.
        family = families.get("radixserve:" + name.removesuffix("_total"))
        assert family is not None and family.samples, name
    for family in families.values():
        assert family.name.startswith("radixserve:"), family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == model, sample
