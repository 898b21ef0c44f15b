"""The serving benchmark's numbers: throughputs and latency distributions, the printed summary, and the plot of
latency percentiles against request rate from several JSON records."""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import numpy as np

from serving_client import RequestResult

PERCENTILES = (("median", 50), ("p90", 90), ("p95", 95), ("p99", 99))


def distribution_ms(values_s: Sequence[float]) -> dict[str, Optional[float]]:
    """mean and percentiles in milliseconds (None for no values)."""
    if not values_s:
        return {"mean": None, **{name: None for name, _ in PERCENTILES}}
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(values.mean()), **{name: float(np.percentile(values, q)) for name, q in PERCENTILES}}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs and latency distributions over the successful requests."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    errors = sorted({r.error for r in results if not r.success})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "short_outputs": sum(r.output_len < r.planned_output_len for r in done),  # ignore_eos not honoured
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # per-request counts from the responses; None when the server reports none
        "reported_cached_tokens": (sum(r.cached_tokens or 0 for r in done)
                                   if any(r.cached_tokens is not None for r in done) else None),
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_latency_ms": distribution_ms([r.latency for r in done]),
        "errors": errors[:5],
    }


def print_summary(record: dict[str, Any]) -> None:
    def row(name: str, value: Any) -> None:
        print(f"{name:<40}{value}")

    print(f"{' Serving benchmark ':=^66}")
    row("Backend:", f"{record['backend']} ({record['base_url']})")
    row("Dataset:", record["dataset"]["name"])
    row("Arrivals:", record["arrival"]["label"])
    row("Requests completed / failed:", f"{record['completed']} / {record['failed']}")
    row("Duration (s):", f"{record['duration_s']:.2f}")
    row("Input / output tokens:", f"{record['total_input_tokens']} / {record['total_output_tokens']}")
    row("Request throughput (req/s):", f"{record['request_throughput']:.2f}")
    row("Input token throughput (tok/s):", f"{record['input_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{record['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{record['total_throughput']:.2f}")
    hit_rate = record["cache_hit_rate"]
    row("Server cache hit rate:", "n/a" if hit_rate is None else f"{hit_rate:.2%}")
    if record["reported_cached_tokens"] is not None:
        row("Cached prompt tokens (responses):", record["reported_cached_tokens"])
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E latency")):
        stats = record[key]
        if stats["mean"] is None:
            row(f"{name} (ms):", "n/a")
        else:
            row(f"{name} mean / median / p99 (ms):", f"{stats['mean']:.2f} / {stats['median']:.2f} / {stats['p99']:.2f}")
    if record["short_outputs"]:
        row("Outputs shorter than planned:", record["short_outputs"])
    for error in record["errors"]:
        print(f"error: {error}")
    print("=" * 66)


def offered_rate(record: dict[str, Any]) -> float:
    rate = record["arrival"]["request_rate"]
    return record["request_throughput"] if rate == "inf" else float(rate)


def plot_records(paths: Sequence[str], output: str) -> None:
    """Median and p99 TTFT, ITL and end-to-end latency against request rate, one line per record label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        series.setdefault(record.get("label") or record["backend"], []).append(record)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, (key, title) in zip(axes, (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E latency"))):
        for color, (name, records) in enumerate(series.items()):
            records = sorted(records, key=offered_rate)
            rates = [offered_rate(r) for r in records]
            for percentile, style in (("median", "-o"), ("p99", "--s")):
                values = [math.nan if r[key][percentile] is None else r[key][percentile] for r in records]
                axis.plot(rates, values, style, color=f"C{color}", label=f"{name} {percentile}")
        axis.set(title=title, xlabel="request rate (req/s)", ylabel="ms")
        axis.grid(True, alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)
    print(f"wrote {output}")

