"""Where the CPU's time goes on the offline shared-prefix workload: forward time by batch mode, and the top ops.

A real Scheduler and ModelRunner in this process (the tests' scheduler driver, no ZMQ), given the 64 requests of
the CPU yardstick at once (G=8 P=8 S=512 Q=32 O=32, as `offline_throughput.py`), stepped to the end:

    python benchmarks/cpu_profile.py --dtype bfloat16                       # the default backend (cpu)
    python benchmarks/cpu_profile.py --dtype float32 --attention-backend torch_native --top 20
    python benchmarks/cpu_profile.py --dtype bfloat16 --max-kernel-extend 64    # longer extends on torch_native

Prints the wall time, the ModelRunner's forward time and the attention backend's share of it per mode (EXTEND,
DECODE, MIXED), and with `--top N` the torch profiler's N most expensive ops by self CPU time, with the CPU's ISA
flags. `--library` runs a library built before (another commit's kernels, from its cache folder) instead of this
checkout's build, to compare two builds in alternating runs.
"""

from __future__ import annotations

import argparse
import collections
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
    args = parser.parse_args()
    if args.library:
        cpu_build.load_library(args.library)

    model_dir = resolve_model(None).model_dir
    sessions = shared_prefix_sessions(load_tokenizer(model_dir), 8, 8, 512, 32, 32)
    extra = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    if args.chunked_prefill_size is not None:
        extra["chunked_prefill_size"] = args.chunked_prefill_size
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
    for i, session in enumerate(sessions):
        driver.submit(f"r{i}", session.turns[0].new_ids, max_new_tokens=32, ignore_eos=True)
    profiler = None
    if args.top:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.__enter__()
    start = time.perf_counter()
    while not all(result.finish_reason for result in driver.results.values()):
        driver.step()
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
    driver.close()

    backend = type(driver.runner.attn_backend).__name__
    print(f"CPU ISA: {cpu_build.cpu_isa()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.dtype}, {backend}")
    print(f"wall {wall:.2f} s; forward time by mode: "
          + ", ".join(f"{mode} {seconds[mode]:.2f} s in {calls[mode]} steps" for mode in sorted(seconds)))
    print("attention (the backend's forward, all layers) by mode: "
          + ", ".join(f"{mode} {attention[mode]:.2f} s" for mode in sorted(attention)))
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
