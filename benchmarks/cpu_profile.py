"""Where the CPU's time goes on the offline shared-prefix workload: forward time by batch mode, and the top ops.

A real Scheduler and ModelRunner in this process (the tests' scheduler driver, no ZMQ), given the 64 requests of
the CPU yardstick at once (G=8 P=8 S=512 Q=32 O=32, as `offline_throughput.py`), stepped to the end:

    python benchmarks/cpu_profile.py --dtype bfloat16                       # the default backend (cpu)
    python benchmarks/cpu_profile.py --dtype float32 --attention-backend torch_native --top 20
    python benchmarks/cpu_profile.py --dtype bfloat16 --max-kernel-extend 64    # longer extends on torch_native
    python benchmarks/cpu_profile.py --gguf --workload streams16 --ops 12   # the GGUF default, 16 streams

`--gguf` runs the embedded GGUF file as `radixserve serve` does on this CPU (its blocks where the CPU's default picks
them; `--dtype` is then auto) instead of its float conversion. `--workload streams16` replays the 16-streams cell of
`cpu_vs_llamacpp.sh` instead: 64 random prompts of 256 tokens, 128 out, at most 16 in flight (a new one as one
ends). `--server-arg NAME=VALUE` (repeatable, Python literals) sets a server argument.

Prints the wall time, the ModelRunner's forward time and the attention backend's share of it per mode (EXTEND,
DECODE, MIXED; the fused decode layers call the attention kernel from C++, outside that share), with `--top N` the
torch profiler's N most expensive ops by self CPU time, and with `--ops N` the N largest kernels' self time split by
their first input's rows (a prefill chunk's 512, a decode step's batch), with the CPU's name and ISA flags. The
profiler those two run (shapes recorded) slows the replay itself, about 2x on the 16-streams workload: read their
split as shares, and the wall time from a run without them. `--library` runs a library built before (another
commit's kernels, from its cache folder) instead of this checkout's build, to compare two builds in alternating runs.
"""

from __future__ import annotations

import argparse
import ast
import collections
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from scheduler_driver import SchedulerDriver  # noqa: E402
from serving_datasets import shared_prefix_sessions  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.runtime.model_files import load_tokenizer, resolve_model  # noqa: E402
from radixserve.runtime.wire.model_files import default_model_path  # noqa: E402

def time_forwards_by_mode(runner) -> tuple[collections.defaultdict, collections.Counter, collections.defaultdict]:
    """Wrap `runner.forward` and its attention backend's `forward` so that each call's wall time adds up by batch
    mode; returns (forward seconds, forward calls, attention seconds), filled as forwards run."""
    seconds, calls, attention = collections.defaultdict(float), collections.Counter(), collections.defaultdict(float)
    forward, attend = runner.forward, runner.attn_backend.forward

    def timed_forward(batch, *a, **k):
        start = time.perf_counter()
        out = forward(batch, *a, **k)
        seconds[batch.mode.name] += time.perf_counter() - start
        calls[batch.mode.name] += 1
        return out

    def timed_attention(q, k, v, layer_id, scaling, batch, *a, **kw):
        start = time.perf_counter()
        out = attend(q, k, v, layer_id, scaling, batch, *a, **kw)
        attention[batch.mode.name] += time.perf_counter() - start
        return out

    runner.forward = timed_forward
    runner.attn_backend.forward = timed_attention
    return seconds, calls, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-backend", default=None, help="default: the CPU's default (cpu)")
    parser.add_argument("--top", type=int, default=0, help="profile and list the N most expensive ops")
    parser.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the CPU's (512)")
    parser.add_argument("--max-kernel-extend", type=int, default=None,
                        help="cpu backend: extends longer than this run on torch_native (default: none do)")
    parser.add_argument("--library", default=None,
                        help="a built radixserve_cpu_kernels.so to run instead of this checkout's build")
    parser.add_argument("--gguf", action="store_true", help="the embedded GGUF file as served (dtype auto)")
    parser.add_argument("--workload", default="shared", choices=("shared", "streams16"))
    parser.add_argument("--ops", type=int, default=0, help="profile; the N largest kernels by their rows")
    parser.add_argument("--server-arg", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    if args.library:
        cpu_build.load_library(args.library)

    model_dir = resolve_model(None).model_dir
    if args.workload == "shared":
        requests = [(session.turns[0].new_ids, 32) for session in
                    shared_prefix_sessions(load_tokenizer(model_dir), 8, 8, 512, 32, 32)]
        in_flight = len(requests)
    else:
        rng = random.Random(0)
        requests = [([rng.randrange(100, 40000) for _ in range(256)], 128) for _ in range(64)]
        in_flight = 16
    extra = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    if args.chunked_prefill_size is not None:
        extra["chunked_prefill_size"] = args.chunked_prefill_size
    for setting in args.server_arg:
        name, _, value = setting.partition("=")
        extra[name] = ast.literal_eval(value)
    if args.gguf:  # as served: the file itself, the CPU's kernel set, the dtype the CPU's default picks
        driver = SchedulerDriver(default_model_path(), check_every_step=False, cpu_kernels="auto", **extra)
    else:
        driver = SchedulerDriver(model_dir, check_every_step=False, dtype=args.dtype, **extra)
    cpu_build.wait()
    if args.max_kernel_extend is not None:
        if not hasattr(driver.runner.attn_backend, "max_extend_len"):
            parser.error("--max-kernel-extend needs the cpu attention backend")
        driver.runner.attn_backend.max_extend_len = args.max_kernel_extend
    driver.submit("warm-up", list(range(11, 19)), max_new_tokens=4, ignore_eos=True)
    driver.run_until_idle()
    driver.flush_cache()

    seconds, calls, attention = time_forwards_by_mode(driver.runner)
    pending = list(enumerate(requests))
    profiler = None
    if args.top or args.ops:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=bool(args.ops))
        profiler.__enter__()
    start = time.perf_counter()
    while pending or not all(result.finish_reason for result in driver.results.values()):
        running = sum(not result.finish_reason for result in driver.results.values())
        while pending and running < in_flight:
            i, (ids, new_tokens) = pending.pop(0)
            driver.submit(f"r{i}", ids, max_new_tokens=new_tokens, ignore_eos=True)
            running += 1
        driver.step()
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
    driver.close()

    backend = type(driver.runner.attn_backend).__name__
    dtype = f"auto ({driver.runner.dtype}, KV {driver.runner.kv_cache_dtype})" if args.gguf else args.dtype
    print(f"CPU: {cpu_build.cpu_model()}; ISA: {cpu_build.cpu_isa()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {dtype}, {backend}; {args.workload}")
    output_tokens = sum(new_tokens for _, new_tokens in requests)
    print(f"wall {wall:.2f} s ({output_tokens / wall:.1f} output tok/s); forward time by mode: "
          + ", ".join(f"{mode} {seconds[mode]:.2f} s in {calls[mode]} steps" for mode in sorted(seconds)))
    print("attention (the backend's forward, all layers) by mode: "
          + ", ".join(f"{mode} {attention[mode]:.2f} s" for mode in sorted(attention)))
    if args.top:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.ops:
        by_rows: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0])
        for event in profiler.key_averages(group_by_input_shape=True):
            if event.key.startswith("radixserve_cpu::"):
                rows = event.input_shapes[0][0] if event.input_shapes and event.input_shapes[0] else None
                by_rows[(event.key, rows)][0] += event.self_cpu_time_total / 1e6
                by_rows[(event.key, rows)][1] += event.count
        print(f"{'kernel':<36} {'rows':>6} {'self s':>8} {'calls':>7}")
        for (name, rows), (total, count) in sorted(by_rows.items(), key=lambda item: -item[1][0])[:args.ops]:
            print(f"{name:<36} {rows!s:>6} {total:8.3f} {count:7d}")


if __name__ == "__main__":
    main()
