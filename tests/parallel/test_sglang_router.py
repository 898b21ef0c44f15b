"""Two `radixserve serve` workers behind a real SGLang Model Gateway (`sglang-router`, the Rust router) process:
the OpenAI client through the router (plain and streamed), native /generate as SGLang's router forwards it
(with its extension fields), the shared-prefix workload keeping >= 80% of the ideal hit rate summed over the
workers under the router's cache-aware policy, and one worker killed without the following requests failing."""

from __future__ import annotations

import concurrent.futures
import random
import subprocess
import sys
import time

import httpx
import pytest

from http_fixtures import ADMIN_KEY, ServerProcess, _die_with_parent, free_port

pytest.importorskip("sglang_router")

WORDS = ("river stone light garden paper window silver market engine orbit signal forest harbor lantern "
         "meadow copper violet thunder canyon pillar").split()


class Router:
    def __init__(self, worker_urls: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", self.url.rpartition(":")[2], "--worker-urls", *worker_urls, "--policy", "cache_aware",
                   "--prometheus-port", str(free_port()), "--log-level", "warn",
                   # One failed attempt opens a worker's circuit, so the retry goes to another worker.
                   "--cb-failure-threshold", "1", "--health-check-interval-secs", "1"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(self.url + "/readiness", timeout=2.0)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == len(worker_urls):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the router did not see its workers in 120 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def cluster():
    workers = [ServerProcess("--admin-api-key", ADMIN_KEY, wait=False) for _ in range(2)]
    for worker in workers:  # both start at once
        worker.wait_healthy()
    router = Router([worker.url for worker in workers])
    yield router, workers
    router.stop()
    for worker in workers:
        worker.stop()


def test_openai_chat_through_the_router(cluster):
    import openai

    router, _ = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a color."}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == reply.choices[0].message.content


@pytest.mark.slow
def test_native_generate_through_the_router(cluster):
    router, _ = cluster
    response = httpx.post(router.url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 4


def _workload(num_groups: int, per_group: int) -> list[list[str]]:
    rng = random.Random(3)
    groups = []
    for group in range(num_groups):
        system = f"Team {group} handbook: " + " ".join(rng.choice(WORDS) for _ in range(150))
        groups.append([f"{system}\nQ{i}: describe the {rng.choice(WORDS)}." for i in range(per_group)])
    return groups


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow
def test_shared_prefix_hit_rate_through_the_cache_aware_router(cluster):
    from radixserve.runtime.model_files import load_tokenizer

    router, workers = cluster
    before = [worker.server_info()["cache"] for worker in workers]
    groups = _workload(4, 4)
    tokenizer = load_tokenizer(workers[0].server_info()["tokenizer_path"])

    def generate(text: str) -> None:
        response = httpx.post(router.url + "/generate", json={
            "text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=300)
        assert response.status_code == 200, response.text

    for group in groups:  # each group's first prompt, then the rest at once
        generate(group[0])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(generate, [prompt for group in groups for prompt in group[1:]]))

    ideal_matched = total = 0
    for group in groups:
        ids = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in group]
        total += sum(len(x) for x in ids)
        ideal_matched += sum(max(_common_prefix(ids[i], ids[j]) for j in range(i)) for i in range(1, len(ids)))
    after = [worker.server_info()["cache"] for worker in workers]
    matched = sum(a["matched_tokens"] - b["matched_tokens"] for a, b in zip(after, before))
    queried = sum(a["queried_tokens"] - b["queried_tokens"] for a, b in zip(after, before))
    assert queried == total - sum(len(group) for group in groups)  # a lookup leaves the last token to compute
    assert matched >= 0.8 * ideal_matched, (matched, ideal_matched, total)


@pytest.mark.slow
def test_a_killed_worker_does_not_fail_the_following_requests(cluster):
    router, workers = cluster
    workers[1].process.kill()
    workers[1].process.wait(10)
    for i in range(6):
        response = httpx.post(router.url + "/generate", json={
            "text": f"Item {i}: a short note about {WORDS[i]}", "sampling_params": {"max_new_tokens": 2}},
            timeout=120)
        assert response.status_code == 200, response.text
