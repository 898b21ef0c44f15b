"""Fair share under a flood: tenant A keeps many streams busy, tenant B sends one request at a time.

For each mode a fresh `radixserve serve` (embedded model unless --model) with a two-tenant tenants file:
- `idle`: B alone (its TTFT on an idle server);
- `fair`: A floods (`--flood-streams` closed-loop streams) while B runs its requests (fair share on, default);
- `fcfs`: the same with `--disable-fair-share`.
B's TTFT (send to the first streamed output) median and p90, and A's output-token throughput while B ran, go
into a table and a JSON record (`--out`). `--max-running-requests` is set below the flood, so A's requests queue:
that queue is what fair share reorders.

What B costs A is measured within one run, so that outside load on a shared machine moves both figures alike:
A's throughput over the second half of the warm-up (the flood alone) against its throughput while B runs (the
drop), and B's share of the tokens the server computed while B ran (the scheduler's per-tenant counters).

    OMP_NUM_THREADS=1 python benchmarks/fairness.py --out docs/results/fairness_cpu_32streams.json

(one PyTorch thread per process on a small shared CPU host: see docs/benchmarks/history/features.md#fair-share-under-a-flood-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import httpx

import _srcpath  # noqa: F401  (radixserve.<folder> from the checkout)
from radixserve.kernels.cpu_build import cpu_isa

KEY_A, KEY_B, ADMIN = "sk-bench-flood", "sk-bench-light", "sk-bench-admin"


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


async def stream_once(client: httpx.AsyncClient, url: str, key: str, prompt: str, output_len: int,
                      on_tokens: Optional[Callable[[int], None]] = None) -> tuple[float, int]:
    """(TTFT in seconds, output tokens) of one streamed /generate request; `on_tokens(n)` as n new tokens arrive."""
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
            if on_tokens is not None:
                on_tokens(chunk["meta_info"]["completion_tokens"] - tokens)
            tokens = chunk["meta_info"]["completion_tokens"]
            if ttft is None and tokens > 0:
                ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def tokens_computed(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Tokens computed per tenant so far (prefill and decode), from the administrator's server info."""
    info = (await client.get(url + "/get_server_info", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    tenants = (info.get("fair_share") or {}).get("tenants") or {}
    return {tenant: float(entry.get("tokens_computed", 0)) for tenant, entry in tenants.items()}


async def run_mode(url: str, args: argparse.Namespace, flood: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flood_streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        flood_tokens = [0]

        def count(new_tokens: int) -> None:
            flood_tokens[0] += new_tokens

        async def flood_stream(i: int) -> None:
            n = 0
            while not stop.is_set():
                await stream_once(client, url, KEY_A, f"Flood stream {i} request {n}: " + args.prompt,
                                  args.flood_output_len, count)
                n += 1

        flooders = [asyncio.create_task(flood_stream(i)) for i in range(args.flood_streams if flood else 0)]
        alone_per_s = None
        if flood:
            await asyncio.sleep(args.warmup_s / 2)  # let the flood fill the rows and the queue
            alone_tokens, alone_start = flood_tokens[0], time.perf_counter()
            await asyncio.sleep(args.warmup_s / 2)
            alone_per_s = (flood_tokens[0] - alone_tokens) / (time.perf_counter() - alone_start)
        computed_before = await tokens_computed(client, url)
        tokens_before = flood_tokens[0]
        started = time.perf_counter()
        ttfts = []
        for n in range(args.light_requests):
            ttft, _ = await stream_once(client, url, KEY_B, f"Light request {n}: " + args.prompt, args.light_output_len)
            ttfts.append(ttft)
        elapsed = time.perf_counter() - started
        flood_during = flood_tokens[0] - tokens_before
        computed = {tenant: value - computed_before.get(tenant, 0.0)
                    for tenant, value in (await tokens_computed(client, url)).items()}
        stop.set()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    ttfts.sort()
    return {"light_ttft_median_s": statistics.median(ttfts), "light_ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "light_ttfts_s": [round(t, 4) for t in ttfts], "window_s": elapsed,
            "flood_tokens_per_s": flood_during / elapsed if flood else None,
            "flood_alone_tokens_per_s": alone_per_s,
            "light_share_of_tokens": (computed.get("light", 0.0) / sum(computed.values())
                                      if flood and sum(computed.values()) else None)}


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
    parser.add_argument("--server-flags", default="",
                        help="more `radixserve serve` flags for every mode, e.g. \"--enable-mixed-chunk\"")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the `finally` that stops the server

    folder = tempfile.mkdtemp(prefix="radixserve-fairness-")
    tenants = os.path.join(folder, "tenants.json")
    with open(tenants, "w") as f:
        json.dump({KEY_A: "flood", KEY_B: "light"}, f)
    base_flags = ["--tenants-file", tenants, "--admin-api-key", ADMIN, "--max-running-requests",
                  str(args.max_running_requests), "--max-queued-requests", "4096", "--log-level", "warning"]
    if args.model:
        base_flags += ["--model-path", args.model]
    base_flags += args.server_flags.split()
    record: dict[str, Any] = {"cpu_isa": cpu_isa(), "cores": os.cpu_count(), "args": vars(args), "modes": {}}
    print(f"CPU: {record['cpu_isa']}, {record['cores']} cores")
    for mode in args.modes.split(","):
        flags = base_flags + (["--disable-fair-share"] if mode == "fcfs" else [])
        server = Server(flags)
        try:
            load_before = os.getloadavg()[0]  # the machine's other load: this is a 2-core shared host
            result = asyncio.run(run_mode(server.url, args, flood=mode != "idle"))
            result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {ADMIN}"},
                             timeout=60).json()
            result["retractions"] = info.get("num_retractions")
        finally:
            server.stop()
        record["modes"][mode] = result
        print(f"{mode}: {json.dumps({k: v for k, v in result.items() if k != 'light_ttfts_s'})}", flush=True)

    modes = record["modes"]
    print("\n| mode | B TTFT median (s) | B TTFT p90 (s) | A tok/s alone | A tok/s while B ran | A's drop | "
          "B's share of tokens | retractions |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, result in modes.items():
        alone, during, share = (result["flood_alone_tokens_per_s"], result["flood_tokens_per_s"],
                                result["light_share_of_tokens"])
        drop = 1 - during / alone if alone and during is not None else None
        result["flood_drop"] = drop
        print(f"| {mode} | {result['light_ttft_median_s']:.3f} | {result['light_ttft_p90_s']:.3f} | "
              f"{_fmt(alone, '.1f')} | {_fmt(during, '.1f')} | {_fmt(drop, '.1%')} | {_fmt(share, '.1%')} | "
              f"{result['retractions']} |")
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


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
