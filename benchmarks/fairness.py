"""Fair share under a flood: tenant A keeps many streams busy, tenant B sends one request at a time.

For each mode a fresh `radixserve serve` (embedded model unless --model) with a two-tenant tenants file:
- `idle`: B alone (its TTFT on an idle server);
- `fair`: A floods (`--flood-streams` closed-loop streams) while B runs its requests (fair share on, default);
- `fcfs`: the same with `--disable-fair-share`.
B's TTFT (send to the first streamed output) median and p90, and A's output-token throughput while B ran, go
into a table and a JSON record (`--out`). `--max-running-requests` is set below the flood, so A's requests queue:
that queue is what fair share reorders.

    python benchmarks/fairness.py --out docs/results/fairness_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx

KEY_A, KEY_B, ADMIN = "sk-bench-flood", "sk-bench-light", "sk-bench-admin"


def cpu_isa() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.machine()
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or platform.machine()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="radixserve-fairness-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(self.port),
                                         *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def stream_once(client: httpx.AsyncClient, url: str, key: str, prompt: str, output_len: int) -> tuple[float, int]:
    """(TTFT in seconds, output tokens) of one streamed /generate request."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}}
    start = time.perf_counter()
    ttft: Optional[float] = None
    tokens = 0
    async with client.stream("POST", url + "/generate", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            tokens = chunk["meta_info"]["completion_tokens"]
            if ttft is None and tokens > 0:
                ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def run_mode(url: str, args: argparse.Namespace, flood: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flood_streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        flood_tokens = [0]

        async def flood_stream(i: int) -> None:
            n = 0
            while not stop.is_set():
                _, tokens = await stream_once(client, url, KEY_A, f"Flood stream {i} request {n}: " + args.prompt,
                                              args.flood_output_len)
                if not stop.is_set():
                    flood_tokens[0] += tokens
                n += 1

        flooders = [asyncio.create_task(flood_stream(i)) for i in range(args.flood_streams if flood else 0)]
        if flood:
            await asyncio.sleep(args.warmup_s)  # let the flood fill the rows and the queue
        tokens_before = flood_tokens[0]
        started = time.perf_counter()
        ttfts = []
        for n in range(args.light_requests):
            ttft, _ = await stream_once(client, url, KEY_B, f"Light request {n}: " + args.prompt, args.light_output_len)
            ttfts.append(ttft)
        elapsed = time.perf_counter() - started
        flood_during = flood_tokens[0] - tokens_before
        stop.set()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    ttfts.sort()
    return {"light_ttft_median_s": statistics.median(ttfts), "light_ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "light_ttfts_s": [round(t, 4) for t in ttfts], "window_s": elapsed,
            "flood_tokens_per_s": flood_during / elapsed if flood else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--flood-streams", type=int, default=32)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--flood-output-len", type=int, default=32)
    parser.add_argument("--light-requests", type=int, default=10)
    parser.add_argument("--light-output-len", type=int, default=8)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--prompt", default="Write a detailed description of a harbour town at dawn, its boats, "
                                            "its fishermen and the market that opens by the water.")
    parser.add_argument("--modes", default="idle,fair,fcfs")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="radixserve-fairness-")
    tenants = os.path.join(folder, "tenants.json")
    with open(tenants, "w") as f:
        json.dump({KEY_A: "flood", KEY_B: "light"}, f)
    base_flags = ["--tenants-file", tenants, "--admin-api-key", ADMIN, "--max-running-requests",
                  str(args.max_running_requests), "--max-queued-requests", "4096", "--log-level", "warning"]
    if args.model:
        base_flags += ["--model-path", args.model]
    record: dict[str, Any] = {"cpu_isa": cpu_isa(), "cores": os.cpu_count(), "args": vars(args), "modes": {}}
    print(f"CPU: {record['cpu_isa']}, {record['cores']} cores")
    for mode in args.modes.split(","):
        flags = base_flags + (["--disable-fair-share"] if mode == "fcfs" else [])
        server = Server(flags)
        try:
            result = asyncio.run(run_mode(server.url, args, flood=mode != "idle"))
            info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {ADMIN}"},
                             timeout=60).json()
            result["retractions"] = info.get("num_retractions")
        finally:
            server.stop()
        record["modes"][mode] = result
        print(f"{mode}: {json.dumps({k: v for k, v in result.items() if k != 'light_ttfts_s'})}", flush=True)

    modes = record["modes"]
    print("\n| mode | B TTFT median (s) | B TTFT p90 (s) | A throughput while B ran (tok/s) | retractions |")
    print("| --- | --- | --- | --- | --- |")
    for mode, result in modes.items():
        throughput = result["flood_tokens_per_s"]
        print(f"| {mode} | {result['light_ttft_median_s']:.3f} | {result['light_ttft_p90_s']:.3f} | "
              f"{'-' if throughput is None else f'{throughput:.1f}'} | {result['retractions']} |")
    if {"idle", "fair", "fcfs"} <= set(modes):
        idle, fair, fcfs = (modes[m]["light_ttft_median_s"] for m in ("idle", "fair", "fcfs"))
        record["fair_vs_idle"] = fair / idle
        record["fcfs_vs_fair"] = fcfs / fair
        print(f"\nB's median TTFT: fair share {fair / idle:.2f}x idle; first come first served {fcfs / fair:.1f}x fair")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
