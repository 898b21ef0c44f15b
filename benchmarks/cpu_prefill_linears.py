"""The bfloat16 prefill linears inside the embedded model's forward, on the CPU: one prompt of `--rows` tokens
extended from scratch, the four projections of every layer timed by forward hooks (no profiler: on 2 cores its
collector thread slows the two-thread ops it times), the whole forward by the wall clock.

    python benchmarks/cpu_prefill_linears.py --rows 512
    python benchmarks/cpu_prefill_linears.py --rows 512 --cpu-kernels auto,-amx-prefill   # prefill on oneDNN

Prints the median forward and, per projection, the median layer's milliseconds times the 30 layers, with the CPU's
ISA flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _srcpath  # noqa: E402,F401
import torch  # noqa: E402
from test_model_forward import make_runner, run_extend  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.runtime.model_files import resolve_model  # noqa: E402

PROJECTIONS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
               "down": "mlp.down_proj"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="prompt tokens (rows of every projection)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-kernels", default="auto", help="the server argument (runtime/wire/cpu_kernels.py)")
    args = parser.parse_args()
    if not cpu_build.load():
        raise SystemExit("the CPU kernels did not build (see the log)")
    torch.set_num_threads(args.threads)
    runner = make_runner(resolve_model(None).model_dir, dtype="bfloat16", max_total_tokens=16 * args.rows + 4096,
                         cpu_kernels=args.cpu_kernels)
    seconds: dict[str, list[float]] = {name: [] for name in PROJECTIONS}
    started: dict[str, float] = {}

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: started.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda *_: seconds[name].append(time.perf_counter() - started[name]))

    for layer in runner.model.model.layers:
        for name, path in PROJECTIONS.items():
            timed(name, layer.get_submodule(path))
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.rows)]
    for _ in range(2):  # warm-up (first calls pack the weights); a fresh request each time, no cache
        run_extend(runner, [prompt], [0])
    for found in seconds.values():
        found.clear()
    forwards = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run_extend(runner, [prompt], [0])
        forwards.append(time.perf_counter() - start)
    layers = len(runner.model.model.layers)
    per_forward = {name: statistics.median(found) * layers * 1e3 for name, found in seconds.items()}
    print(f"ISA {cpu_build.cpu_isa()}, torch {torch.__version__}, {args.threads} thread(s); bfloat16, {args.rows} rows, "
          f"AMX prefill loop from {runner.cpu_kernels.linear(torch.bfloat16).amx_prefill_from or 'never'}")
    print(f"forward {statistics.median(forwards) * 1e3:.1f} ms (median of {args.repeats}); projections, ms a forward: "
          + "  ".join(f"{name} {ms:.2f}" for name, ms in per_forward.items()) + f"  sum {sum(per_forward.values()):.1f}")


if __name__ == "__main__":
    main()
