"""LoRA admin routes under `--dp-size 2` (a real server with two scheduler replicas, a real HTTP client): a load
or unload that fails on one replica is rolled back on the other, so both keep serving the same adapters.

The partial failure is a real one: an unload is refused by the replica where a request of the adapter runs, and
accepted by the idle one; the idle one loads the adapter again, so requests pinned to either replica still find
it. Once nothing uses it, the unload succeeds on both."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from http_fixtures import ServerProcess
from lora_adapters import make_adapter

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    path = make_adapter(str(tmp_path_factory.mktemp("lora-dp") / "alpha"), default_model_dir, rank=4, seed=21,
                        std=0.05)
    process = ServerProcess("--dp-size", "2", "--lora-paths", f"alpha={path}", "--log-level", "warning",
                            "--lora-adapter-dir", os.path.dirname(path))
    yield process, path
    process.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300.0)


def generate_on(server, rank: int, lora: str = "alpha") -> httpx.Response:
    return post(server, "/generate", {"text": "Hello there", "lora_path": lora, "data_parallel_rank": rank,
                                      "sampling_params": {"max_new_tokens": 2, "temperature": 0}})


def test_an_unload_refused_by_one_replica_is_undone_on_the_other(server):
    process, path = server
    running, stop = threading.Event(), threading.Event()

    def busy_stream() -> None:  # keeps alpha in use on replica 0 until told to stop (the disconnect aborts it)
        body = {"text": "Tell me a long story.", "stream": True, "lora_path": "alpha", "data_parallel_rank": 0,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
        with httpx.stream("POST", process.url + "/generate", json=body, timeout=300.0) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    running.set()
                if stop.is_set():
                    break

    thread = threading.Thread(target=busy_stream)
    thread.start()
    try:
        assert running.wait(300)
        busy = post(process, "/unload_lora_adapter", {"lora_name": "alpha"})
        assert busy.status_code == 400 and "in use" in busy.json()["error_message"]
        assert busy.json()["loaded_adapters"] == {"alpha": path}
    finally:
        stop.set()
        thread.join()
    process.wait_idle(60)
    for rank in (0, 1):  # replica 1 unloaded alpha, then loaded it again
        assert generate_on(process, rank).status_code == 200, rank

    unloaded = post(process, "/unload_lora_adapter", {"lora_name": "alpha"})
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {}
    for rank in (0, 1):
        assert generate_on(process, rank).status_code == 400, rank
    assert post(process, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": path}).status_code == 200
    for rank in (0, 1):
        assert generate_on(process, rank).status_code == 200, rank


def test_a_load_that_fails_everywhere_leaves_the_adapters_as_they_were(server):
    process, path = server
    broken = os.path.join(os.path.dirname(path), "broken")
    os.makedirs(broken, exist_ok=True)
    bad = post(process, "/load_lora_adapter", {"lora_name": "broken", "lora_path": broken})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error_message"]
    assert set(bad.json()["loaded_adapters"]) == {"alpha"}
    for rank in (0, 1):
        assert generate_on(process, rank, "broken").status_code == 400
        assert generate_on(process, rank).status_code == 200
    twice = post(process, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": path})
    assert twice.status_code == 400 and "already loaded" in twice.json()["error_message"]
    for rank in (0, 1):  # a refused second load of a loaded adapter does not unload it anywhere
        assert generate_on(process, rank).status_code == 200
