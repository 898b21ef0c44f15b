"""Overlap scheduler on vs off under a decode-heavy load: throughput, and how much of the time the GPU waits
for the host between decode steps.

    # Llama-3.1-8B shape, random bf16 weights, on a GPU:
    python benchmarks/overlap_idle.py --model .gpu-assets/llama-3.1-8b-dummy --load-format dummy \\
        --dtype bfloat16 --batch-size 64 --input-len 256 --output-len 512
    # the embedded model on the CPU (wall-clock figures only):
    python benchmarks/overlap_idle.py --device cpu --batch-size 8 --input-len 64 --output-len 64 --steps 20

A real Scheduler and ModelRunner run in this process (no tokenizer or detokenizer processes; the scheduler's
output messages are built and taken every step as the server loop does). `--batch-size` requests of random
prompts are submitted at once with `ignore_eos`; once `--warmup-steps` decode steps have run with the whole
batch decoding, `--steps` scheduler steps are timed (decode tokens / wall time) under `torch.profiler` tracing device activity only. The
GPU's busy time is the union of the intervals of every kernel and copy it ran in that window; idle is the
rest of the span from the first to the last one. Both schedulers use the same ModelRunner (same CUDA
graphs, same weights), one after the other. Prints a table and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _srcpath  # noqa: E402,F401
import torch  # noqa: E402

from radixserve.model_runner.model_runner import ModelRunner  # noqa: E402
from radixserve.model_runner.runner_config import RunnerConfig  # noqa: E402
from radixserve.runtime.wire.messages import SamplingParams, TokenizedGenerateReq  # noqa: E402
from radixserve.runtime.wire.server_args import ServerArgs  # noqa: E402
from radixserve.scheduler.scheduler import Scheduler  # noqa: E402


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(length of the union of the intervals, span from the first start to the last end), same unit."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (current_start, current_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > current_end:
            busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += current_end - current_start
    return busy, max(end for _, end in intervals) - intervals[0][0]


def device_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device-side event (kernels, copies, memsets) of a profile."""
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]


def run(args, runner: ModelRunner, overlap: bool) -> dict:
    server_args = ServerArgs(**runner_args(args), disable_overlap_schedule=not overlap,
                             check_invariants_when_idle=False)
    scheduler = Scheduler(server_args, runner, tokenizer=None)
    rng = random.Random(args.seed)
    vocab = runner.vocab_size
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]
        scheduler.handle_message(TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling_params=params))
    while scheduler.waiting or scheduler.chunked_req or scheduler.stats.decode_steps < args.warmup_steps:
        scheduler.step()
        scheduler.take_outputs()
    assert len(scheduler.running) == args.batch_size, "every request must be decoding during the timed window"
    cuda = runner.device.type == "cuda"
    tokens_before, steps_before = scheduler.stats.generated_tokens, scheduler.stats.decode_steps
    # Device activity only: host-side tracing would slow the very host work being measured.
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if cuda else None
    with profiler or contextlib.nullcontext():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            scheduler.step()
            scheduler.take_outputs()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    tokens = scheduler.stats.generated_tokens - tokens_before
    steps = scheduler.stats.decode_steps - steps_before
    result = {"overlap": overlap, "seconds": seconds, "decode_steps": steps, "tokens": tokens,
              "tokens_per_s": tokens / seconds, "ms_per_step": seconds / steps * 1e3}
    if cuda:
        busy, span = busy_and_span(device_intervals(profiler))
        result.update(gpu_busy_ms=busy / 1e3, gpu_span_ms=span / 1e3,
                      gpu_idle_fraction=1 - busy / span if span else None)
    while not scheduler.is_idle():
        scheduler.step()
        scheduler.take_outputs()
    ok, message = scheduler.flush_cache()
    assert ok, message
    scheduler.shutdown()
    return result


def runner_args(args) -> dict:
    return dict(model_path=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                max_running_requests=max(args.batch_size, 8))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
    args = parser.parse_args(argv)
    if args.warmup_steps + args.steps + 2 > args.output_len:
        parser.error("--output-len must exceed --warmup-steps + --steps (the batch must stay whole)")

    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(**runner_args(args))))
    results = [run(args, runner, overlap) for overlap in (True, False)]
    on, off = results
    print(f"\ndecode-heavy load: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"{args.steps} timed steps, {runner.device}, {args.dtype}")
    print(f"{'overlap':<9}{'ms/step':>10}{'tok/s':>11}{'GPU idle':>10}")
    for r in results:
        idle = "-" if r.get("gpu_idle_fraction") is None else f"{r['gpu_idle_fraction']:.1%}"
        print(f"{'on' if r['overlap'] else 'off':<9}{r['ms_per_step']:>10.2f}{r['tokens_per_s']:>11.0f}{idle:>10}")
    print(f"throughput ratio on/off: {on['tokens_per_s'] / off['tokens_per_s']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    record = {"args": vars(args), "device": str(runner.device),
              "device_name": torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "results": results}
    path = os.path.join(args.out, "overlap_idle.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
