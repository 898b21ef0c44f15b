"""A reliability run against real `radixserve serve` processes: the figures of docs/reliability.md.

    python benchmarks/reliability.py --out docs/results/reliability.json

Measures, each on a fresh server of the embedded model:
1. abort storm: 64 streaming requests, half dropped by their clients mid-stream and half aborted by rid, then
   the KV slots still held once the server is idle (must be 0);
2. fuzzing: random JSON bodies on every route (hypothesis), counting 5xx answers (must be 0);
3. child death: for the scheduler and the detokenizer, the time until a pending stream fails and until the server
   exits (non-zero), and the processes left behind;
4. SIGTERM with requests in flight: exit code, drain time, processes left;
5. tenants: what tenant A can learn of tenant B (server info keys and namespaces, salts, rid collisions, flush);
6. the slowest /health during a maximal (20 MB) body.
Prints a table and writes a JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import string
import sys
import threading
import time
import uuid
from typing import Any, Callable

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from http_fixtures import ADMIN_KEY, KEY_A, KEY_B, ServerProcess, tenants_file  # noqa: E402

from radixserve.kernels.cpu_build import cpu_isa  # noqa: E402

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/abort_request", "/flush_cache")
GET_ROUTES = ("/v1/models", "/health", "/get_model_info", "/get_server_info", "/metrics", "/health_generate")


def descendants(server: ServerProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.process.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


def left_alive(processes: list[psutil.Process]) -> int:
    count = 0
    for process in processes:
        try:
            count += process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    return count


def abort_storm(server: ServerProcess) -> dict[str, Any]:
    body = {"text": "Tell me a long story.", "stream": True, "sampling_params": {"max_new_tokens": 2000,
                                                                                "ignore_eos": True}}

    def dropped() -> None:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 4:
                    return

    def aborted(rid: str) -> None:
        with httpx.stream("POST", server.url + "/generate", json={**body, "rid": rid}, timeout=120) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 4:
                    httpx.post(server.url + "/abort_request", json={"rid": rid}, timeout=30)

    threads = [threading.Thread(target=dropped) for _ in range(32)]
    threads += [threading.Thread(target=aborted, args=(f"storm-{i}",)) for i in range(32)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    info = server.wait_idle(timeout=60)
    memory = info["memory"]
    return {"requests": 64, "seconds": round(time.monotonic() - started, 1),
            "leaked_kv_slots": memory["total_tokens"] - memory["free_tokens"] - memory["evictable_tokens"],
            "protected_tokens": memory["protected_tokens"]}


def fuzz(server: ServerProcess, examples: int) -> dict[str, Any]:
    rng = random.Random(0)
    scalars: list[Callable[[], Any]] = [
        lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-2**70, 2**70),
        lambda: rng.choice([0, 1, -1, 2**63, 1e309, float("nan")]), lambda: rng.random() * rng.choice([1, 1e6]),
        lambda: "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 20))),
        lambda: rng.choice(["", "user", "\u0000", "🙂" * 10, "x" * 5000]),
    ]
    fields = ["messages", "prompt", "text", "input_ids", "sampling_params", "rid", "model", "temperature", "top_p",
              "stop", "stream", "logit_bias", "seed", "n", "max_tokens", "max_new_tokens", "logprobs", "cache_salt",
              "response_format", "regex", "ebnf", "min_tokens", "top_k", "echo", "tools"]

    def value(depth: int = 0) -> Any:
        kind = rng.random()
        if depth < 2 and kind < 0.2:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 2 and kind < 0.35:
            return {rng.choice(fields): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return rng.choice(scalars)()

    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, headers=server.headers(ADMIN_KEY), timeout=120) as client:
        for _ in range(examples):
            body = {rng.choice(fields): value() for _ in range(rng.randint(0, 4))}
            body.setdefault("max_tokens", 2)
            raw = json.dumps(body, allow_nan=True).encode()
            if rng.random() < 0.1:
                raw = raw[: rng.randint(0, len(raw))]
            code = client.post(rng.choice(ROUTES), content=raw,
                               headers={"Content-Type": "application/json"}).status_code
            statuses[code] = statuses.get(code, 0) + 1
            code = client.get(rng.choice(GET_ROUTES)).status_code
            statuses[code] = statuses.get(code, 0) + 1
    return {"requests": sum(statuses.values()), "server_errors": sum(n for c, n in statuses.items() if c >= 500),
            "statuses": {str(code): n for code, n in sorted(statuses.items())}}


def child_death(victim: str) -> dict[str, Any]:
    server = ServerProcess("--log-level", "error")
    try:
        kids = sorted(descendants(server), key=lambda p: p.create_time())
        target = kids[0 if victim == "scheduler" else 1]
        ended: dict[str, float] = {}

        def stream() -> None:
            body = {"text": "Tell me a long story.", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
                for _ in response.iter_lines():
                    pass
            ended["stream"] = time.monotonic()

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.5)
        killed = time.monotonic()
        target.kill()
        reader.join(30)
        code = server.process.wait(60)
        exited = time.monotonic()
        time.sleep(1.0)
        return {"victim": victim, "pending_failed_after_s": round(ended.get("stream", float("nan")) - killed, 2),
                "server_exited_after_s": round(exited - killed, 2), "exit_code": code,
                "processes_left": left_alive(kids)}
    finally:
        server.stop()


def sigterm_drain() -> dict[str, Any]:
    server = ServerProcess("--log-level", "error", "--graceful-shutdown-timeout", "3")
    kids = descendants(server)
    body = {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.post(server.url + "/generate", json=body, timeout=120).status_code)) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)
    seconds = time.monotonic() - sent
    for thread in threads:
        thread.join(30)
    time.sleep(1.0)
    return {"exit_code": code, "drain_seconds": round(seconds, 2), "in_flight_answered": len(results),
            "processes_left": left_alive(kids)}


def tenant_observations() -> dict[str, Any]:
    server = ServerProcess("--log-level", "error", "--tenants-file", tenants_file(), "--admin-api-key", ADMIN_KEY,
                           api_key=KEY_A, admin_key=ADMIN_KEY)
    try:
        salt = f"salt-{uuid.uuid4().hex}"
        rid = f"rid-{uuid.uuid4().hex}"
        headers_a, headers_b = server.headers(KEY_A), server.headers(KEY_B)
        long_b = threading.Thread(target=lambda: httpx.post(server.url + "/generate", headers=headers_b, timeout=120,
                                                            json={"text": "Count:", "rid": rid, "sampling_params": {
                                                                "max_new_tokens": 400, "ignore_eos": True}}))
        long_b.start()
        httpx.post(server.url + "/v1/completions", headers=headers_b, timeout=60,
                   json={"prompt": "B's prompt", "max_tokens": 1, "cache_salt": salt})
        time.sleep(0.5)
        info_a = httpx.get(server.url + "/get_server_info", headers=headers_a, timeout=30)
        text_a = info_a.text
        observations = {
            "traffic_keys_seen": [k for k in ("num_requests", "num_running_reqs", "num_queued_reqs", "memory",
                                              "gen_throughput", "token_usage") if k in info_a.json()],
            "other_namespaces_seen": [n for n in info_a.json()["cache"]["namespaces"] if "beta" in n],
            "salt_seen_by_a": salt in text_a,
            "salt_seen_by_admin": salt in httpx.get(server.url + "/get_server_info", timeout=30,
                                                    headers=server.headers(ADMIN_KEY)).text,
            "rid_collision_refused": httpx.post(server.url + "/generate", headers=headers_a, timeout=60, json={
                "text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}}).status_code != 200,
            "flush_by_tenant_status": httpx.post(server.url + "/flush_cache", headers=headers_a, timeout=30).status_code,
            "metrics_by_tenant_status": httpx.get(server.url + "/metrics", headers=headers_a, timeout=30).status_code,
        }
        httpx.post(server.url + "/abort_request", headers=headers_b, json={"rid": rid}, timeout=30)
        long_b.join(60)
        observations["cross_tenant_observations"] = (
            len(observations["traffic_keys_seen"]) + len(observations["other_namespaces_seen"])
            + observations["salt_seen_by_a"] + observations["salt_seen_by_admin"]
            + observations["rid_collision_refused"] + (observations["flush_by_tenant_status"] == 200)
            + (observations["metrics_by_tenant_status"] == 200))
        return observations
    finally:
        server.stop()


def health_during_max_body() -> dict[str, Any]:
    server = ServerProcess("--log-level", "error")
    try:
        text = "lorem ipsum dolor sit amet " * (20 * 1024 * 1024 // 27)
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.setdefault("status", httpx.post(
            server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=300).status_code))
        worker.start()
        slowest = 0.0
        while worker.is_alive():
            started = time.monotonic()
            httpx.get(server.url + "/health", timeout=60)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)
        return {"body_mb": 20, "status": result.get("status"), "slowest_health_s": round(slowest, 3)}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-examples", type=int, default=300)
    parser.add_argument("--out", default="reliability.json")
    args = parser.parse_args()
    record: dict[str, Any] = {"cpu_isa": cpu_isa(), "cores": os.cpu_count()}
    server = ServerProcess("--log-level", "error", "--tenants-file", tenants_file(), "--admin-api-key", ADMIN_KEY,
                           api_key=KEY_A, admin_key=ADMIN_KEY)
    try:
        record["abort_storm"] = abort_storm(server)
        record["fuzz"] = fuzz(server, args.fuzz_examples)
    finally:
        server.stop()
    record["child_death"] = [child_death("scheduler"), child_death("detokenizer")]
    record["sigterm"] = sigterm_drain()
    record["tenants"] = tenant_observations()
    record["max_body"] = health_during_max_body()

    rows = [
        ("leaked KV slots after an abort storm (64 streams)", record["abort_storm"]["leaked_kv_slots"]),
        (f"5xx under fuzzing ({record['fuzz']['requests']} requests)", record["fuzz"]["server_errors"]),
    ]
    for death in record["child_death"]:
        rows.append((f"{death['victim']} killed: pending stream failed after (s)", death["pending_failed_after_s"]))
        rows.append((f"{death['victim']} killed: server exited after (s), exit code",
                     f"{death['server_exited_after_s']}, {death['exit_code']}"))
        rows.append((f"{death['victim']} killed: processes left", death["processes_left"]))
    rows.append(("SIGTERM with 4 in flight: exit code, drain (s), processes left",
                 f"{record['sigterm']['exit_code']}, {record['sigterm']['drain_seconds']}, "
                 f"{record['sigterm']['processes_left']}"))
    rows.append(("cross-tenant observations", record["tenants"]["cross_tenant_observations"]))
    rows.append(("slowest /health during a 20 MB body (s)", record["max_body"]["slowest_health_s"]))
    width = max(len(name) for name, _ in rows)
    print(f"CPU: {record['cpu_isa']}, {record['cores']} cores")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
