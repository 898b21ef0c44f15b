"""`sgl.Runtime`: a real `radixserve serve` process launched from a script, used as the DSL's backend."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

import radixserve as sgl
from radixserve.frontend.runtime import _first_free_port


@sgl.function
def skeleton(s, topic):
    s += "Three tips for " + topic + ":\n"
    forks = s.fork(2)
    for i in range(2):
        forks[i] += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=3, stop="\n")
    forks.join()


async def _collect(pieces) -> list:
    return [piece async for piece in pieces]


@pytest.mark.slow
def test_runtime_serves_programs_and_stops():
    runtime = sgl.Runtime(log_level="warning", max_running_requests=4, graceful_shutdown_timeout=2)
    try:
        assert runtime.url == f"http://127.0.0.1:{runtime.server_args.port}"
        assert httpx.get(runtime.url + "/health").status_code == 200
        sgl.set_default_backend(runtime)
        # SGLang keeps the Runtime itself as the default (its test_gen_min_new_tokens reads the model name so).
        assert sgl.global_config.default_backend is runtime
        assert sgl.global_config.default_backend.endpoint.get_model_name() == runtime.endpoint.model_name

        state = skeleton.run(topic="sleep", temperature=0)
        assert isinstance(state["tip"], list) and len(state["tip"]) == 2
        info = sgl.get_server_info()
        assert info["cache"]["matched_tokens"] > 0  # the branches reused the prefix the fork prefilled
        assert sgl.flush_cache() is True
        assert asyncio.run(runtime.get_server_info())["num_running_reqs"] == 0

        # SGLang's Runtime helpers: generate (a JSON string) and async_generate (streamed pieces).
        params = {"max_new_tokens": 5, "temperature": 0}
        result = json.loads(runtime.generate("The capital of France is", params))
        pieces = asyncio.run(_collect(runtime.async_generate("The capital of France is", params)))
        assert "".join(pieces) == result["text"] and result["meta_info"]["completion_tokens"] == 5
        assert runtime.get_tokenizer().decode(result["output_ids"], skip_special_tokens=True) == result["text"]
    finally:
        sgl.set_default_backend(None)
        process, port = runtime._process, runtime.server_args.port
        runtime.shutdown()
    assert process.returncode == 0 and runtime.pid is None
    with socket.socket() as sock:  # nothing listens there any more
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    runtime.shutdown()  # idempotent


def test_runtime_reports_a_server_that_fails_to_start(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"):
        sgl.Runtime(model_path=str(tmp_path / "no-such-model"), launch_timeout=120)


def test_runtime_takes_the_next_free_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _first_free_port("127.0.0.1", port) > port
