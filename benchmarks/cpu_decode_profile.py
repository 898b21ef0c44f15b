"""Where one stream's decode step goes on the CPU: the embedded model's forward split into its linears, attention,
norms, rotary embedding and SiLU-mul, next to sampling and the scheduler's own work around them.

A real Scheduler and ModelRunner in this process (the tests' scheduler driver, no ZMQ), one request of `--input-len`
prompt tokens decoding `--output-len` tokens greedily, as the one-stream cell of `cpu_vs_llamacpp.sh` does:

    python benchmarks/cpu_decode_profile.py --mode bfloat16
    python benchmarks/cpu_decode_profile.py --mode gguf --top 15         # + torch profiler's top ops by self time

Two passes of the same request: the first untimed inside (the step's wall time alone), the second with a timer around
every part, whose own cost (a few microseconds per call, ~250 calls a step) shows as the difference of the two step
times. Where the model runs every layer in one C++ call (GGUF blocks, model_runner/fused_decode.py), the first pass
runs as served, and a second untimed pass and the timed one run the layers one by one, so that the parts show. Each
part is reported per decode step in milliseconds, medians over the steps. The server adds the ZMQ hops and the
detokenizer on top: compare `step` with the server's ITL (`cpu_vs_llamacpp.sh`).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from scheduler_driver import SchedulerDriver  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.model_runner import layers  # noqa: E402
from radixserve.model_runner.models import llama  # noqa: E402
from radixserve.runtime.wire.model_files import default_model_path  # noqa: E402

# --mode -> server arguments
MODES = {
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "float32": {"dtype": "float32", "quantization": "none"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "gguf-int8": {"dtype": "float32", "quantization": "gguf", "gguf_activations": "int8"},
}
_MISSING = object()
PARTS = ("linears", "lm_head", "attention", "attention_plan", "embedding", "norms", "rotary", "silu_mul", "sampling")


class PartTimers:
    """Seconds spent in each part during the current step, by wrapping the callables that make it up."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        inner = getattr(owner, attr)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if part == "forward":  # the thread governor sets the count per step
                seconds["threads"] = torch.get_num_threads()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        original = vars(owner).get(attr, _MISSING)  # a class's, a module's or an instance's own attribute
        setattr(owner, attr, timed)
        self._restore.append(lambda: delattr(owner, attr) if original is _MISSING else setattr(owner, attr, original))

    def restore(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()


def instrument(driver: SchedulerDriver, timers: PartTimers) -> None:
    runner, model = driver.runner, driver.runner.model
    for name, module in model.named_modules():
        if name == "logits_head":  # timed with the rest of the LM head's work
            continue
        if not list(module.children()) and hasattr(module, "in_features") and hasattr(module, "out_features"):
            timers.wrap(module, "forward", "linears")
        elif isinstance(module, layers.RMSNorm):
            timers.wrap(module, "forward", "norms")
    timers.wrap(runner.attn_backend, "forward", "attention")
    timers.wrap(runner.attn_backend, "plan", "attention_plan")
    timers.wrap(model.model.embed_tokens, "forward", "embedding")
    timers.wrap(layers.RotaryEmbedding, "__call__", "rotary")
    timers.wrap(llama, "silu_and_mul", "silu_mul")
    timers.wrap(driver.scheduler.executor.sampler, "sample", "sampling")
    timers.wrap(model, "compute_logits", "lm_head")
    timers.wrap(runner, "forward", "forward")


def decode_steps(driver: SchedulerDriver, prompt: list[int], output_len: int,
                 timers: PartTimers | None) -> list[dict[str, float]]:
    """Run one request to its end; per decode step, the step's wall time and each part's seconds."""
    driver.flush_cache()
    driver.submit("r", prompt, max_new_tokens=output_len, ignore_eos=True)
    driver.step()  # the prefill
    steps = []
    while not driver.results["r"].finish_reason:
        if timers is not None:
            timers.seconds.clear()
        start = time.perf_counter()
        driver.step()
        record = {"step": time.perf_counter() - start}
        if timers is not None:
            record.update(timers.seconds)
        steps.append(record)
    driver.results.pop("r")
    return steps


@contextlib.contextmanager
def profiled(top: int) -> Iterator[None]:
    if not top:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bfloat16", choices=sorted(MODES))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=0, help="profile a third pass and list the N most expensive ops")
    parser.add_argument("--server-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="another server argument (a Python literal value); repeatable")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()

    extra = {name: ast.literal_eval(value) for name, value in (a.split("=", 1) for a in args.server_arg)}
    driver = SchedulerDriver(default_model_path(), check_every_step=False, cpu_kernels="auto", **MODES[args.mode],
                             **extra)
    cpu_build.wait()
    prompt = [(7 * i + 11) % 20000 + 100 for i in range(args.input_len)]
    decode_steps(driver, prompt, 8, None)  # warm-up

    plain = decode_steps(driver, prompt, args.output_len, None)
    # The parts are timed on the layers one by one: a model that runs them in one C++ call
    # (model_runner/fused_decode.py) has that turned off for the other passes, whose untimed step is reported beside.
    inner = driver.runner.model.model
    fused, inner.fused_decode = getattr(inner, "fused_decode", None), None
    layers_plain = decode_steps(driver, prompt, args.output_len, None) if fused is not None else plain
    timers = PartTimers()
    instrument(driver, timers)
    timed = decode_steps(driver, prompt, args.output_len, timers)
    timers.restore()
    if fused is not None:
        inner.fused_decode = fused
    with profiled(args.top):
        decode_steps(driver, prompt, min(args.output_len, 32), None)
    driver.close()

    def median_ms(steps: list[dict[str, float]], key: str) -> float:
        return 1e3 * statistics.median(s.get(key, 0.0) for s in steps)

    parts = {part: median_ms(timed, part) for part in PARTS}
    forward = median_ms(timed, "forward")
    inside = sum(parts[part] for part in PARTS[:-1])
    record = {
        "mode": args.mode, "cpu_isa": cpu_build.cpu_isa(), "load_average": os.getloadavg(),
        "threads": statistics.median(s["threads"] for s in timed), "input_len": args.input_len,
        "output_len": args.output_len,
        "fused_decode": fused is not None, "step_ms": median_ms(plain, "step"),
        "layers_step_ms": median_ms(layers_plain, "step"), "timed_step_ms": median_ms(timed, "step"),
        "forward_ms": forward,
        "parts_ms": parts, "forward_other_ms": forward - inside,
        "outside_forward_ms": median_ms(timed, "step") - forward - parts["sampling"],
    }
    print(f"CPU ISA {record['cpu_isa']}; torch {torch.__version__}, {record['threads']} threads a step (median); "
          f"load average {' '.join(f'{x:.2f}' for x in record['load_average'])}; {args.mode}, {args.input_len} in / "
          f"{args.output_len} out, medians per decode step")
    print(f"{'part':<60}{'ms':>8}")
    rows = [("step, untimed" + (" (every layer in one C++ call)" if fused is not None else ""), record["step_ms"])]
    if fused is not None:
        rows.append(("step, untimed, the layers one by one (split below)", record["layers_step_ms"]))
    rows += [("step, timed", record["timed_step_ms"]), ("  forward", forward)]
    names = {"linears": "linears (projections)", "lm_head": "LM head (logits)", "attention_plan": "attention plan"}
    rows += [(f"    {names.get(part, part)}", parts[part]) for part in PARTS[:-1]]
    rows += [("    rest of the forward (the layers' Python, splits, views)", record["forward_other_ms"]),
             ("  sampling", parts["sampling"]), ("  scheduler outside forward and sampling",
                                                  record["outside_forward_ms"])]
    for name, ms in rows:
        print(f"{name:<60}{ms:>8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
