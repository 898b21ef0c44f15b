"""Agent sessions under KV pressure: retained sessions (prompt_cache_key + prompt_cache_retention) against plain LRU.

N concurrent sessions each run T turns of a growing conversation: a system prompt of its own, then per turn a user
message (every `--tool-every`-th turn a larger tool result instead), the model's answer appended to the context, and a
think time between turns (uniform in [0.5, 1.5] x `--think`). The KV pool is set to `--pool-fraction` of the working
set (every session's final context), so the sessions cannot all stay cached. For each mode a fresh server runs the
same workload (same seeds):
- `lru`: no retention fields, today's behaviour;
- `retain`: every request names its session and a retention of `--retention` seconds, kept on the device (the
  tenant's quota is `--quota-fraction` of the pool);
- `host-lru` and `host-retain`: the same two with the host tier on (`--enable-hierarchical-cache`, a host tier of
  `--host-fraction` of the working set), where retained sessions are kept on the host (quota `--quota-fraction` of
  the host tier) and the device is left to the running turns. Prompts
are token ids drawn at random (no tokenizer in the loop), so every prefix a turn shares with the last is exact.

Per mode: the cached share of the ideal for turns >= 2 (ideal: the previous turn's prompt and answer, less the last
answer token, whose KV is never computed), the hit rate over all prompt tokens, TTFT p50 / p99 of turns >= 2,
and output throughput over the run. A table, and a JSON record (`--out`).

    OMP_NUM_THREADS=1 python benchmarks/agents.py --out docs/results/agents_cpu.json           # CPU, embedded model
On the GPU host (after the set-up of benchmarks/gpu_e2e.sh: the wheels and the project installed into /tmp/site,
PYTHONPATH=/tmp/site:$PWD/benchmarks, and its 8B dummy model folder), the 8B shape:

    python3 benchmarks/agents.py --model-path .gpu-assets/llama-3.1-8b-dummy --server-flag=--load-format \\
        --server-flag=dummy --server-flag=--dtype --server-flag=bfloat16 --sessions 64 --turns 10 --think 5 \\
        --system-tokens 4000 --user-tokens 400 --tool-tokens 2000 --output-tokens 64 --vocab 120000 \\
        --out $OUT/agents_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

import _srcpath  # noqa: F401  (radixserve.<folder> from the checkout)
from radixserve.kernels.cpu_build import cpu_isa

MODES = ("lru", "retain", "host-lru", "host-retain")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`radixserve serve` started from the temporary folder: `python -m` puts the working directory first on
    sys.path, where a checkout's thin radixserve/ would shadow the installed package (the GPU host installs it)."""

    def __init__(self, flags: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(prefix="radixserve-agents-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port",
                                         self.url.rsplit(":", 1)[1], *flags], stdout=self.log,
                                        stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not start; see {self.log.name}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached: int
    ttft: float
    output_tokens: int


@dataclass
class Session:
    index: int
    context: list[int]
    rng: random.Random
    turns: list[Turn] = field(default_factory=list)


def tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(count)]


async def generate(client: httpx.AsyncClient, url: str, input_ids: list[int], args: argparse.Namespace,
                   session_key: Optional[str]) -> tuple[float, list[int], dict[str, Any]]:
    """(TTFT, output ids, final meta_info) of one streamed /generate request."""
    body: dict[str, Any] = {"input_ids": input_ids, "stream": True, "sampling_params": {
        "max_new_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0}}
    if session_key is not None:
        body.update(prompt_cache_key=session_key, prompt_cache_retention=args.retention)
    start = time.perf_counter()
    ttft: Optional[float] = None
    last: dict[str, Any] = {}
    async with client.stream("POST", url + "/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            if ttft is None and last["meta_info"]["completion_tokens"] > 0:
                ttft = time.perf_counter() - start
    return (ttft or time.perf_counter() - start), list(last["output_ids"]), last["meta_info"]


async def run_session(client: httpx.AsyncClient, url: str, session: Session, args: argparse.Namespace,
                      retain: bool) -> None:
    rng = session.rng
    ideal = 0
    await asyncio.sleep(rng.uniform(0, args.think))  # sessions start staggered
    for turn in range(args.turns):
        is_tool = turn > 0 and args.tool_every > 0 and turn % args.tool_every == 0
        session.context += tokens(rng, args.tool_tokens if is_tool else args.user_tokens, args.vocab)
        ttft, output, meta = await generate(client, url, session.context, args,
                                            f"session-{session.index}" if retain else None)
        session.turns.append(Turn(session.index, turn, int(meta["prompt_tokens"]), int(meta["cached_tokens"]),
                                  ideal, ttft, len(output)))
        ideal = len(session.context) + len(output) - 1
        session.context += output
        await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think)


def summarize(sessions: list[Session], seconds: float) -> dict[str, Any]:
    turns = [t for s in sessions for t in s.turns]
    later = [t for t in turns if t.turn >= 1]
    ttfts = sorted(t.ttft for t in later)

    def quantile(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else 0.0

    return {
        "cached_of_ideal": sum(t.cached_tokens for t in later) / max(1, sum(t.ideal_cached for t in later)),
        "hit_rate": sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else 0.0,
        "ttft_p99_s": quantile(0.99),
        "output_tokens_per_s": sum(t.output_tokens for t in turns) / seconds,
        "seconds": seconds,
        "turns": len(turns),
    }


async def run_mode(url: str, args: argparse.Namespace, retain: bool) -> dict[str, Any]:
    sessions = [Session(i, [], random.Random(args.seed * 1000 + i)) for i in range(args.sessions)]
    for session in sessions:
        session.context = tokens(session.rng, args.system_tokens, args.vocab)
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(run_session(client, url, s, args, retain) for s in sessions))
        seconds = time.perf_counter() - start
        info = (await client.get(url + "/get_server_info")).json()
    return {**summarize(sessions, seconds), "retention": info.get("retention")}


def working_set(args: argparse.Namespace) -> int:
    per_session = args.system_tokens + args.turns * args.output_tokens
    for turn in range(args.turns):
        is_tool = turn > 0 and args.tool_every > 0 and turn % args.tool_every == 0
        per_session += args.tool_tokens if is_tool else args.user_tokens
    return per_session * args.sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=160)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--tool-tokens", type=int, default=120)
    parser.add_argument("--tool-every", type=int, default=2, help="every k-th turn brings a tool result")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--think", type=float, default=2.0, help="mean think time between turns, seconds")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / working set")
    parser.add_argument("--quota-fraction", type=float, default=0.5, help="retention quota / KV pool")
    parser.add_argument("--retention", type=float, default=600.0, help="seconds a session's prefix is kept")
    parser.add_argument("--host-fraction", type=float, default=1.0, help="host tier / working set (host-* modes)")
    parser.add_argument("--vocab", type=int, default=20000, help="token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--server-flag", action="append", default=[], help="another flag for the server")
    parser.add_argument("--out", default="benchmarks/results/agents.json")
    args = parser.parse_args()

    pool = max(256, int(working_set(args) * args.pool_fraction))
    host_ratio = args.host_fraction * working_set(args) / pool
    common = ["--max-total-tokens", str(pool), "--skip-server-warmup", "--log-level", "warning", *args.server_flag]
    if args.model_path:
        common += ["--model-path", args.model_path]
    if args.device:
        common += ["--device", args.device]
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; expected {MODES}")
        kept_in = pool
        flags = list(common)
        if mode.startswith("host-"):
            flags += ["--enable-hierarchical-cache", "--hicache-ratio", f"{host_ratio:.4f}"]
            kept_in = int(pool * host_ratio)
        flags += ["--retention-quota-tokens", str(int(kept_in * args.quota_fraction))]
        server = Server(flags)
        try:
            results[mode] = asyncio.run(run_mode(server.url, args, retain=mode.endswith("retain")))
        finally:
            server.stop()

    print(f"{args.sessions} sessions x {args.turns} turns, working set {working_set(args)} tokens, KV pool {pool} "
          f"tokens, host tier {int(pool * host_ratio)} tokens (host-* modes), think {args.think} s, ISA {cpu_isa()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':12} {'cached/ideal':>12} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>10}")
    for mode, result in results.items():
        print(f"{mode:12} {result['cached_of_ideal']:12.1%} {result['hit_rate']:9.1%} {result['ttft_p50_s']:8.3f}s "
              f"{result['ttft_p99_s']:8.3f}s {result['output_tokens_per_s']:10.1f}")
    for mode in ("retain", "host-lru", "host-retain"):
        if "lru" in results and mode in results and results[mode]["ttft_p50_s"] > 0:
            print(f"TTFT p50 lru / {mode}: {results['lru']['ttft_p50_s'] / results[mode]['ttft_p50_s']:.2f}x")
    record = {"benchmark": "agents", "isa": cpu_isa(), "load_average": os.getloadavg()[0], "args": vars(args),
              "pool_tokens": pool, "host_tokens": int(pool * host_ratio),
              "working_set_tokens": working_set(args), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
