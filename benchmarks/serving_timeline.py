"""Where a serving run's inter-token gaps come from: a record of `serving.py --output-details`, read back in time.

    python benchmarks/serving_timeline.py RECORD.json [--server-log SERVER.log] [--bin 0.5]

Prints, from the client's side:
- the gap distribution (every gap between two chunks of a stream), with and without each stream's first gap (a
  request admitted while others still prefill waits for them once);
- a timeline in bins of `--bin` seconds from the first send: chunks received, and gaps over 100 / 300 ms ending in
  each bin;
- server-wide stalls: stretches of more than `--stall-ms` in which no stream received anything while requests
  were running. A stall that every stream sees at once is the server's, not the network's.

With `--server-log`, the server's own timestamped lines are placed on the same clock (the record keeps the wall
time of its first send): the scheduler's `Prefill batch.` / `Decode batch.` lines and the
`long garbage collection` warnings of `--gc-warning-threshold-secs`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from typing import Optional, Sequence

import numpy as np

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)")
LOG_EVENTS = ("Prefill batch.", "Decode batch.", "long garbage collection")


def chunk_times(details: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every chunk's arrival (s from the first send, sorted); every gap (ms), when it ended (s), and whether it
    was its stream's first."""
    arrivals, gaps, ends, first = [], [], [], []
    for request in details:
        if request["error"]:
            continue
        t = request["start_s"] + request["ttft_ms"] / 1e3
        arrivals.append(t)
        for i, gap in enumerate(request["itl_ms"]):
            t += gap / 1e3
            arrivals.append(t)
            gaps.append(gap)
            ends.append(t)
            first.append(i == 0)
    return np.sort(np.asarray(arrivals)), np.asarray(gaps), np.asarray(ends), np.asarray(first, dtype=bool)


def server_lines(path: str, origin_unix: float) -> list[tuple[float, str]]:
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = LOG_TIME.match(line)
            if match and any(event in line for event in LOG_EVENTS):
                when = datetime.fromisoformat(match.group(1).replace(",", ".")).timestamp()
                out.append((when - origin_unix, line.strip()[len(match.group(1)):].strip()))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("record")
    parser.add_argument("--server-log", default=None)
    parser.add_argument("--bin", type=float, default=0.5, help="timeline bin, seconds")
    parser.add_argument("--stall-ms", type=float, default=120.0)
    args = parser.parse_args(argv)
    with open(args.record, encoding="utf-8") as f:
        record = json.load(f)
    if "details" not in record:
        raise SystemExit("the record has no per-request details: run serving.py with --output-details")
    arrivals, gaps, ends, first = chunk_times(record["details"])
    if not len(gaps):
        raise SystemExit("no inter-token gaps in the record")
    print(f"gaps {len(gaps)}: median {np.median(gaps):.2f} ms, p90 {np.percentile(gaps, 90):.1f}, "
          f"p99 {np.percentile(gaps, 99):.1f}; without first gaps p99 {np.percentile(gaps[~first], 99):.1f}; "
          f"first gaps mean {gaps[first].mean():.0f} ms")
    print(f"gaps over 300 ms: {(gaps > 300).sum()} ({(first & (gaps > 300)).sum()} of them first gaps); "
          f"over 100 ms: {(gaps > 100).sum()}; under 1 ms: {(gaps < 1).sum()}")

    bins = np.arange(0.0, arrivals.max() + args.bin, args.bin)
    received, _ = np.histogram(arrivals, bins)
    over_100, _ = np.histogram(ends[gaps > 100], bins)
    over_300, _ = np.histogram(ends[gaps > 300], bins)
    print(f"\n{'t s':>6} {'chunks':>7} {'>100ms':>7} {'>300ms':>7}")
    for i, count in enumerate(received):
        print(f"{bins[i]:6.1f} {count:7d} {over_100[i]:7d} {over_300[i]:7d}")

    silent = np.diff(arrivals)
    stalls = [(float(arrivals[i]), float(silent[i]) * 1e3) for i in np.nonzero(silent * 1e3 > args.stall_ms)[0]]
    print(f"\nserver-wide stalls over {args.stall_ms:.0f} ms (start s, ms): "
          + (", ".join(f"{start:.2f} {ms:.0f}" for start, ms in stalls) or "none"))

    if args.server_log:
        origin_unix = record.get("details_origin_unix_s")
        if origin_unix is None:
            raise SystemExit("the record predates details_origin_unix_s: its server lines cannot be placed")
        print("\nserver lines (s from the first send):")
        for when, text in server_lines(args.server_log, origin_unix):
            if when >= -1.0:
                print(f"{when:8.2f}  {text[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
