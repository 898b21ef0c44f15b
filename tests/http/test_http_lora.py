"""LoRA adapters on a real server with the embedded model (SmolLM2-135M), a real HTTP client.

- a batch mixing two adapters and the base model gives, per prompt, Hugging Face's greedy tokens with that
  adapter merged into the weights (float32, CPU);
- the same prompt under a second adapter reports cached_tokens 0 (KV is never shared across adapters);
- adapters are models of the OpenAI routes (`model` = name or `<served>:<name>`), listed by /v1/models;
- unknown adapters are a 400 (a 404 as an OpenAI `model`), a bad load is a 400 naming why;
- hot load and unload while requests run: nothing fails, a busy adapter refuses to unload, and once idle every
  KV slot is free or cached (the accounting holds).
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from http_fixtures import ServerProcess
from lora_adapters import make_adapter, merged_greedy

pytestmark = [pytest.mark.timeout(900)]
PROMPTS = ["The capital of France is", "Write a short poem about the moon:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-smollm2")
    return {
        "alpha": make_adapter(str(root / "alpha"), default_model_dir, rank=8, alpha=16, seed=11, std=0.06),
        "beta": make_adapter(str(root / "beta"), default_model_dir, rank=4, alpha=8, seed=12, std=0.08,
                             modules=("q_proj", "v_proj", "down_proj")),
        "gamma": make_adapter(str(root / "gamma"), default_model_dir, rank=8, seed=13, std=0.06),
    }


@pytest.fixture(scope="module")
def server(adapters):
    process = ServerProcess("--lora-paths", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}",
                            "--max-loras-per-batch", "2", "--log-level", "warning",
                            "--lora-adapter-dir", os.path.dirname(adapters["alpha"]))
    yield process
    process.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300.0)


def tokenize(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def test_a_mixed_batch_matches_merged_hugging_face(server, adapters, default_model_dir):
    prompts = [tokenize(default_model_dir, text) for text in PROMPTS]
    names = [None, "alpha", "beta"]
    body = {"input_ids": prompts, "lora_path": names,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    outputs = [item["output_ids"] for item in response.json()]
    for prompt, name, output in zip(prompts, names, outputs):
        assert output == merged_greedy(default_model_dir, adapters.get(name), [prompt], 10)[0], name
    base_of_alpha = merged_greedy(default_model_dir, None, [prompts[1]], 10)[0]
    assert outputs[1] != base_of_alpha  # the adapter really changes the output


@pytest.mark.slow
def test_the_same_prompt_under_another_adapter_reuses_no_kv(server):
    body = {"text": "A long shared prompt about tenants and adapters, " * 4,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = post(server, "/generate", {**body, "lora_path": "alpha"}).json()["meta_info"]
    again = post(server, "/generate", {**body, "lora_path": "alpha"}).json()["meta_info"]
    other = post(server, "/generate", {**body, "lora_path": "beta"}).json()["meta_info"]
    base = post(server, "/generate", body).json()["meta_info"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] > 0
    assert other["cached_tokens"] == 0 and base["cached_tokens"] == 0


@pytest.mark.slow
def test_adapters_are_models_of_the_openai_routes(server):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    served = models[0]["id"]
    assert {m["id"] for m in models[1:]} == {"alpha", "beta"}
    assert all(m["parent"] == served for m in models[1:])
    assert httpx.get(server.url + "/v1/models/beta", timeout=30).json()["parent"] == served
    native = post(server, "/generate", {"text": PROMPTS[1], "lora_path": "beta",
                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    for model in ("beta", f"{served}:beta"):
        completion = post(server, "/v1/completions", {"model": model, "prompt": PROMPTS[1], "max_tokens": 6,
                                                      "temperature": 0})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == native["text"]
    chat = post(server, "/v1/chat/completions", {"model": "alpha", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] in (served, "alpha")


@pytest.mark.slow
def test_unknown_adapters_and_bad_loads_are_400s(server, adapters, tmp_path):
    unknown = post(server, "/generate", {"text": "Hi", "lora_path": "nope"})
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]
    served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    assert post(server, "/v1/completions", {"model": f"{served}:nope", "prompt": "Hi"}).status_code == 404
    openai = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "lora_path": "nope"})
    assert openai.status_code == 400
    empty = os.path.join(os.path.dirname(adapters["alpha"]), "empty")
    os.makedirs(empty, exist_ok=True)
    bad = post(server, "/load_lora_adapter", {"lora_name": "empty", "lora_path": empty})
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert "adapter_config.json" in bad.json()["error_message"]
    twice = post(server, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": "empty"})  # under the folder
    assert twice.status_code == 400 and "already loaded" in twice.json()["error_message"]
    assert post(server, "/unload_lora_adapter", {"lora_name": "nope"}).status_code == 400
    assert post(server, "/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # lora_path missing


@pytest.mark.slow
def test_adapters_load_only_from_under_the_adapter_folder(server, adapters, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    for path in (str(outside), "../" + os.path.basename(str(tmp_path)), "alpha/../../etc", "/etc"):
        refused = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert refused.status_code == 403, path
        assert refused.json()["error"]["code"] == "lora_path_not_allowed"
    inside_link = os.path.join(os.path.dirname(adapters["alpha"]), "link-out")
    if not os.path.lexists(inside_link):
        os.symlink(outside, inside_link)  # a link inside the folder that points out of it is refused too
    assert post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": inside_link}).status_code == 403
    assert post(server, "/unload_lora_adapter", {"lora_name": "x"}).status_code == 400  # nothing was loaded


@pytest.mark.slow
def test_hot_load_and_unload_while_requests_run(server, adapters):
    failures: list[str] = []

    def stream(name) -> None:
        body = {"text": "Tell me a story about a lighthouse keeper.", "stream": True, "lora_path": name,
                "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=300.0) as response:
            if response.status_code != 200:
                failures.append(f"{name}: {response.status_code}")
            for _ in response.iter_lines():
                pass

    threads = [threading.Thread(target=stream, args=(name,)) for name in ("alpha", None, "alpha", None)]
    for thread in threads:
        thread.start()
    loaded = post(server, "/load_lora_adapter", {"lora_name": "gamma", "lora_path": adapters["gamma"]})
    assert loaded.status_code == 200 and set(loaded.json()["loaded_adapters"]) == {"alpha", "beta", "gamma"}
    assert post(server, "/generate", {"text": "Hi", "lora_path": "gamma",
                                      "sampling_params": {"max_new_tokens": 4}}).status_code == 200
    busy = post(server, "/unload_lora_adapter", {"lora_name": "alpha"})
    assert busy.status_code == 400 and "in use" in busy.json()["error_message"]
    assert post(server, "/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    for thread in threads:
        thread.join()
    assert not failures
    server.wait_idle(60)  # every KV slot free or cached: nothing leaked
    assert post(server, "/unload_lora_adapter", {"lora_name": "alpha"}).json()["loaded_adapters"] == {
        "beta": adapters["beta"]}
    assert post(server, "/generate", {"text": "Hi", "lora_path": "alpha"}).status_code == 400
    assert post(server, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": adapters["alpha"]}).status_code == 200
    server.wait_idle(60)
