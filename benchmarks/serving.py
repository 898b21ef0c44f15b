"""Serving benchmark: a load generator for any server that speaks native `/generate` or OpenAI `/v1/completions`.

    radixserve serve --port 30000 &
    python benchmarks/serving.py --dataset generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 4 \
        --gsp-system-prompt-len 256 --gsp-question-len 32 --gsp-output-len 16
    python benchmarks/serving.py --backend openai --base-url http://127.0.0.1:8000 --model M --dataset random \
        --random-input-len 128 --random-output-len 64 --num-prompts 100 --request-rate 4 --label vllm
    python benchmarks/serving.py plot a.json b.json c.json -o latency.png     # latency percentiles vs request rate

Workloads come from serving_datasets.py (random token ids; the native backend sends the ids, the OpenAI backend
their text), requests from serving_client.py (streaming, `ignore_eos`, greedy by default), numbers and the plot
from serving_report.py.

Arrivals: open loop, where sessions start at Poisson times (`--request-rate R`) or all at once (`inf`, the
default) whatever the server's progress; or closed loop (`--max-concurrency N` with rate `inf`), where at most N
requests are in flight and a new one starts when one finishes. Both flags together: Poisson arrivals capped at N
in flight. Turns of one multi-turn conversation run one after the other; conversations run concurrently.

Measured per request: TTFT, ITL (gaps between output chunks: one per token on radixserve), TPOT ((latency -
TTFT) / (output tokens - 1)) and end-to-end latency. The cache hit rate is the server's: prompt tokens served
from its prefix cache / prompt tokens queried, from the `cache` counters of `/get_server_info` read after the
warmup and after the run (other traffic during the run counts too); n/a for servers without that route.

Output: a summary on stdout and a JSON record (`--output-file`, default benchmarks/results/serving-<time>.json)
holding the arguments, the arrival mode, throughputs, latency distributions (ms: mean, median, p90, p95, p99),
failures and the cache hit rate; the exit status is 1 when a request failed. The `plot` command draws median
and p99 TTFT, ITL and end-to-end latency against the offered request rate (the measured request throughput for
records sent all at once or closed loop), one line per `--label`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from datetime import datetime
from typing import Any, Optional, Sequence

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also when imported by tests
from serving_client import (  # noqa: E402
    BACKENDS, RequestResult, Target, arrival_label, run_sessions, run_sessions_in_processes,
)
from serving_datasets import (  # noqa: E402
    DATASETS,
    Session,
    multi_turn_sessions,
    random_sessions,
    shared_prefix_sessions,
    warmup_session,
)
from serving_report import plot_records, print_summary, summarize  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def server_info(target: Target) -> Optional[dict]:
    """The server's `/get_server_info`, or None when it has no such route (another engine)."""
    try:
        response = httpx.get(target.base_url + "/get_server_info", headers=target.headers(), timeout=30.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def cache_counters(info: Optional[dict]) -> Optional[dict[str, int]]:
    """The cumulative prefix-cache counters (prompt tokens matched and queried) of a server info, if it has them."""
    cache = (info or {}).get("cache")
    if not isinstance(cache, dict) or "matched_tokens" not in cache or "queried_tokens" not in cache:
        return None
    return {"matched_tokens": int(cache["matched_tokens"]), "queried_tokens": int(cache["queried_tokens"])}


def cache_hit_rate(before: Optional[dict], after: Optional[dict]) -> Optional[float]:
    """Prompt tokens matched / queried between two counter snapshots; None when unknown or nothing queried."""
    if before is None or after is None:
        return None
    queried = after["queried_tokens"] - before["queried_tokens"]
    return (after["matched_tokens"] - before["matched_tokens"]) / queried if queried > 0 else None


def build_sessions(args: argparse.Namespace, tokenizer) -> list[Session]:
    """The workload the command line asks for (see serving_datasets.py)."""
    if args.dataset == "random":
        return random_sessions(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_sessions(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                      args.seed)
    return multi_turn_sessions(tokenizer, args.num_prompts, args.mt_turns, args.mt_first_len, args.mt_user_len,
                               args.mt_output_len, args.seed)


def dataset_params(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset's name, its own arguments (without their flag prefix) and the seed, for the record."""
    prefix = {"random": "random_", "generated-shared-prefix": "gsp_", "multi-turn": "mt_"}[args.dataset]
    params = {name[len(prefix):]: value for name, value in vars(args).items() if name.startswith(prefix)}
    if args.dataset != "generated-shared-prefix":
        params["num_prompts"] = args.num_prompts
    return {"name": args.dataset, **params, "seed": args.seed}


def load_tokenizer_for(path: Optional[str]):
    """The tokenizer at `path`, or the embedded default model's (its converted directory loads fastest)."""
    from radixserve.runtime.model_files import load_tokenizer, resolve_model

    return load_tokenizer(path or resolve_model(None).model_dir)


SERVER_FIELDS = ("model_path", "device", "dtype", "attention_backend", "radix_cache", "hierarchical_cache",
                 "overlap_schedule", "max_total_num_tokens", "max_running_requests", "chunked_prefill_size",
                 "schedule_policy")


def lower_tier_figures(info: Optional[dict]) -> Optional[dict]:
    """The hierarchical cache's host/disk memory figures and tier counters of a radixserve server info, if any."""
    cache, memory = (info or {}).get("cache") or {}, (info or {}).get("memory") or {}
    if not isinstance(cache, dict) or "hicache" not in cache:
        return None
    return {"memory": {k: v for k, v in memory.items() if k.startswith(("host_", "disk_"))}, **cache["hicache"]}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run behind the CLI: build the workload, warm up, run, measure; returns the JSON record."""
    target = Target(args.backend, args.base_url.rstrip("/"), args.api_key, args.model, args.prompt_as_text,
                    args.temperature)
    tokenizer = load_tokenizer_for(args.tokenizer)
    sessions = build_sessions(args, tokenizer)
    if args.flush_cache:
        httpx.post(target.base_url + "/flush_cache", headers=target.headers(), timeout=60.0).raise_for_status()
    if not args.disable_warmup:
        warmup, _ = asyncio.run(run_sessions(target, [warmup_session(tokenizer)], progress=False))
        if not warmup[0].success:
            raise SystemExit(f"warmup request failed: {warmup[0].error}")
    info_before = server_info(target)
    loop, label = arrival_label(args.request_rate, args.max_concurrency)
    print(f"{len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} requests; {label}")
    if args.client_processes > 1:
        results, duration = run_sessions_in_processes(target, sessions, args.client_processes, args.request_rate,
                                                      args.max_concurrency, args.seed, args.request_timeout)
    else:
        results, duration = asyncio.run(run_sessions(target, sessions, args.request_rate, args.max_concurrency,
                                                     args.seed, not args.disable_tqdm, args.request_timeout))
    info_after = server_info(target)
    before, after = cache_counters(info_before), cache_counters(info_after)
    details = {}
    if args.output_details:
        origin = min((r.start for r in results), default=0.0)
        details = {"details_origin_s": origin, "details_origin_unix_s": time.time() - (time.perf_counter() - origin),
                   "details": request_details(results)}
    return {
        "kind": "serving",
        "timestamp": datetime.now().isoformat(timespec="seconds"),
        "label": args.label or args.backend,
        "backend": args.backend,
        "base_url": target.base_url,
        "dataset": dataset_params(args),
        "client_processes": args.client_processes,
        "arrival": {"loop": loop, "label": label, "max_concurrency": args.max_concurrency,
                    "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate},
        "num_requests": len(results),
        **summarize(results, duration),
        "cache_hit_rate": cache_hit_rate(before, after),
        "cache_counters": {"before": before, "after": after},
        "hicache": lower_tier_figures(info_after),
        "server": {name: info_before.get(name) for name in SERVER_FIELDS} if info_before else None,
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "httpx": httpx.__version__},
        **details,
    }


def request_details(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per request: when it was sent (s after the first send, which the record keeps as `details_origin_s` on the
    host's monotonic clock, `time.perf_counter()`, shared by the client processes), its time to first token and its
    inter-token gaps (ms)."""
    first = min((r.start for r in results), default=0.0)
    return [{"start_s": round(r.start - first, 4), "ttft_ms": round(r.ttft * 1e3, 2),
             "itl_ms": [round(gap * 1e3, 2) for gap in r.itl], "output_len": r.output_len, "error": r.error}
            for r in results]


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError("the request rate must be positive (or inf)")
    return rate


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serving benchmark (`serving.py plot REC.json... -o OUT.png` to plot).")
    p.add_argument("--backend", choices=BACKENDS, default="radixserve",
                   help="radixserve: native /generate; openai: /v1/completions")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the OpenAI 'model' field (omitted by default)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the embedded SmolLM2 model's)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (random) or conversations (multi-turn)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths drawn from [L * r, L]")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-first-len", type=int, default=256, help="tokens of a conversation's first prompt")
    p.add_argument("--mt-user-len", type=int, default=64, help="new user tokens per later turn")
    p.add_argument("--mt-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second; inf: at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most N requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-as-text", action="store_true", help="radixserve backend: send text, not input_ids")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    p.add_argument("--disable-warmup", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds; default none")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes sharing the requests (one Python process saturates on many streams)")
    p.add_argument("--label", default=None, help="the series name in plots (default: the backend)")
    p.add_argument("--output-file", default=None, help="default benchmarks/results/serving-<time>.json")
    p.add_argument("--output-details", action="store_true",
                   help="also record each request's send time, TTFT and inter-token gaps")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        plot = argparse.ArgumentParser(prog="serving.py plot", description="latency percentiles vs request rate")
        plot.add_argument("records", nargs="+", help="JSON records written by serving.py")
        plot.add_argument("-o", "--output", default="serving-latency.png")
        plot_args = plot.parse_args(argv[1:])
        plot_records(plot_args.records, plot_args.output)
        return 0
    args = run_parser().parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be at least 1")
    record = {"command": ["benchmarks/serving.py", *argv], **run_benchmark(args)}
    print_summary(record)
    output = args.output_file or os.path.join(RESULTS_DIR, f"serving-{datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(f"record written to {output}")
    return 0 if record["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
