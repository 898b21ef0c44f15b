"""Where the serving benchmark's time goes on the CPU, without the HTTP server: random prompts arriving as a
Poisson process are fed to a real Scheduler and ModelRunner in this process (the tests' scheduler driver, no
ZMQ, no tokenizer or detokenizer processes), which is stepped as the server's loop steps it.

    python benchmarks/cpu_serving_profile.py --dtype bfloat16 --rate 8               # serving.py random 128/64
    python benchmarks/cpu_serving_profile.py --dtype float32 --rate 8 --top 20        # + torch profiler's top ops
    python benchmarks/cpu_serving_profile.py --dtype float32 --rate 8 --busy-share 0.25   # another process busy
    python benchmarks/cpu_serving_profile.py --rate 8 --server-arg enable_mixed_chunk=True --server-arg ...

Prints the CPU's ISA, the ModelRunner's forward time per batch mode, the scheduler's time outside the forward,
and TTFT / inter-token latency / end-to-end medians and p99 measured from the arrival times to the end of the
step that produced each token (a client would add the HTTP and detokenization path). `--busy-share S` runs a
second process that keeps one core busy S of every 5 ms, as a load generator or an HTTP front end sharing the
machine would. `--server-arg NAME=VALUE` (repeatable) sets a server argument (Python literal values).
"""

from __future__ import annotations

import argparse
import ast
import collections
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from cpu_profile import time_forwards_by_mode  # noqa: E402
from scheduler_driver import SchedulerDriver  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.runtime.model_files import resolve_model  # noqa: E402

BUSY_LOOP = """
import sys, time
share, period = float(sys.argv[1]), 0.005
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < share * period:
        pass
    time.sleep((1 - share) * period)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=134, help="prompt tokens (serving.py's 128-token texts "
                        "come to about 134 tokens)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--top", type=int, default=0, help="profile and list the N most expensive ops")
    parser.add_argument("--busy-share", type=float, default=0.0, help="share of one core another process takes")
    parser.add_argument("--server-arg", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()

    server_args = {}
    for item in args.server_arg:
        name, _, value = item.partition("=")
        server_args[name] = ast.literal_eval(value)
    driver = SchedulerDriver(resolve_model(None).model_dir, check_every_step=False, dtype=args.dtype, **server_args)
    cpu_build.wait()
    rng = random.Random(args.seed)
    driver.submit("warm-up", [rng.randrange(100, 40000) for _ in range(args.input_len)], max_new_tokens=8,
                  ignore_eos=True)
    driver.run_until_idle()
    driver.flush_cache()
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(args.rate)
        arrivals.append(t)

    seconds, calls, attention = time_forwards_by_mode(driver.runner)
    busy = None
    if args.busy_share > 0:
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_share)])
    profiler = None
    if args.top:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.__enter__()
    token_times: dict[int, list[float]] = collections.defaultdict(list)
    steps, step_seconds, submitted = 0, 0.0, 0
    start = time.perf_counter()
    try:
        while submitted < len(prompts) or not driver.scheduler.is_idle():
            while submitted < len(prompts) and arrivals[submitted] <= time.perf_counter() - start:
                driver.submit(f"r{submitted}", prompts[submitted], max_new_tokens=args.output_len, ignore_eos=True)
                submitted += 1
            if driver.scheduler.is_idle():
                time.sleep(max(0.0, arrivals[submitted] - (time.perf_counter() - start)))
                continue
            step_start = time.perf_counter()
            driver.step()
            now = time.perf_counter()
            steps += 1
            step_seconds += now - step_start
            for i in range(submitted):
                times = token_times[i]
                times.extend([now - start] * (len(driver.results[f"r{i}"].output_ids) - len(times)))
    finally:
        if busy is not None:
            busy.kill()
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
    driver.close()

    ttft = [token_times[i][0] - arrivals[i] for i in range(len(prompts))]
    itl = [b - a for i in range(len(prompts)) for a, b in zip(token_times[i], token_times[i][1:])]
    e2e = [token_times[i][-1] - arrivals[i] for i in range(len(prompts))]
    outside = step_seconds - sum(seconds.values())
    print(f"CPU ISA: {cpu_build.cpu_isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.dtype}, rate {args.rate}, {len(prompts)} x {args.input_len}/{args.output_len}, "
          f"busy share {args.busy_share}, server args {server_args}")
    print(f"wall {wall:.2f} s, {steps} steps; forward by mode: " + ", ".join(
        f"{mode} {seconds[mode]:.2f} s in {calls[mode]} ({1e3 * seconds[mode] / calls[mode]:.1f} ms each)"
        for mode in sorted(seconds)) + f"; outside the forward {outside:.2f} s ({1e3 * outside / steps:.2f} ms a step)")
    print("attention (the backend's forward, all layers) by mode: "
          + ", ".join(f"{mode} {attention[mode]:.2f} s" for mode in sorted(attention)))
    print(f"TTFT median / p99 {1e3 * statistics.median(ttft):.0f} / {1e3 * percentile(ttft, 0.99):.0f} ms; "
          f"ITL {1e3 * statistics.median(itl):.1f} / {1e3 * percentile(itl, 0.99):.0f} ms; "
          f"E2E median {1e3 * statistics.median(e2e):.0f} ms")
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
