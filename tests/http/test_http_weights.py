"""The post-training routes on a real server (runtime/http/weights_api.py), with a tiny model and a real HTTP client:
a weight update from base64 tensors serves Hugging Face's greedy tokens with the new weights, drops the cache and
moves the weight version; pause / continue and memory release / resume keep serving the same outputs; the routes
need the administrator, and pickled tensors are refused.
"""

from __future__ import annotations

import base64
import threading

import httpx
import pytest

from http_fixtures import ServerProcess
from test_weight_updates import _prompts, hf_greedy, hf_model, perturbed_state

pytestmark = [pytest.mark.timeout(600)]
ADMIN, USER = "sk-admin-rl", "sk-user-rl"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess("--model-path", model_dir, "--dtype", "float32", "--api-key", USER, "--admin-api-key",
                            ADMIN, "--log-level", "warning", "--max-request-bytes", str(1 << 27),
                            api_key=USER, admin_key=ADMIN)
    yield process
    process.stop()


def post(server, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(key), timeout=300.0)


def generate(server, prompts: list[list[int]]) -> list[dict]:
    response = post(server, "/generate", {"input_ids": prompts, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}, key=USER)
    assert response.status_code == 200, response.text
    return response.json()


def encoded(name: str, tensor) -> dict:
    raw = tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": base64.b64encode(raw).decode()}


def test_update_weights_from_tensor_over_http(server, model_dir):
    model = hf_model(model_dir)
    prompts = _prompts(model.config.vocab_size)
    before = generate(server, prompts)
    assert [r["output_ids"] for r in before] == hf_greedy(model, prompts)

    state = perturbed_state(model, seed=3)
    body = {"named_tensors": [encoded(name, tensor) for name, tensor in state.items()]}
    assert post(server, "/update_weights_from_tensor", body, key=USER).status_code == 403
    response = post(server, "/update_weights_from_tensor", body)
    assert response.status_code == 200, response.text
    assert response.json()["success"] and response.json()["weight_version"] == "1"

    after = generate(server, prompts)
    assert [r["output_ids"] for r in after] == hf_greedy(model, prompts)
    assert [r["meta_info"]["cached_tokens"] for r in after] == [0] * len(prompts)
    assert {r["meta_info"]["weight_version"] for r in after} == {"1"}
    version = httpx.get(server.url + "/get_weight_version", headers=server.headers(USER), timeout=30.0)
    assert version.json() == {"weight_version": "1"}
    values = post(server, "/get_weights_by_name", {"name": "model.norm.weight"}).json()
    assert values == pytest.approx(state["model.norm.weight"].tolist())


@pytest.mark.slow
def test_bad_requests_are_refused(server):
    response = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]})
    assert response.status_code == 400 and "unpickle" in response.json()["error"]["message"]
    response = post(server, "/update_weights_from_tensor", {"named_tensors": [
        {"name": "model.norm.weight", "dtype": "float32", "shape": [64], "data": base64.b64encode(b"x" * 8).decode()}]})
    assert response.status_code == 400 and "bytes" in response.json()["message"]
    response = post(server, "/pause_generation", {"mode": "sideways"})
    assert response.status_code == 400 and "mode" in response.json()["message"]
    response = post(server, "/release_memory_occupation", {"tags": ["gpu"]})
    assert response.status_code == 400


@pytest.mark.slow
def test_pause_continue_and_memory_release_keep_outputs(server, model_dir):
    prompts = _prompts(1000, lengths=(7, 12))
    expected = [r["output_ids"] for r in generate(server, prompts)]

    assert post(server, "/pause_generation", {"mode": "in_place"}).json()["success"]
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(generate(server, prompts)))
    waiter.start()
    waiter.join(timeout=2.0)
    assert waiter.is_alive(), "a paused server runs no batch"
    assert post(server, "/continue_generation", {}).json()["success"]
    waiter.join(timeout=120.0)
    assert [r["output_ids"] for r in results[0]] == expected

    assert post(server, "/release_memory_occupation", {}).json()["success"]
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 400  # already
    assert post(server, "/resume_memory_occupation", {}).json()["success"]
    again = generate(server, prompts)
    assert [r["output_ids"] for r in again] == expected
    assert [r["meta_info"]["cached_tokens"] for r in again] == [0, 0]  # the cache went with the KV pool
