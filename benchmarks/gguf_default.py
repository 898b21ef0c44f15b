"""The CPU's default for a GGUF model, side by side in one process: the float path (`--quantization none`), the blocks
chosen by default, the blocks asked for (`--quantization gguf`) and the blocks with int8 activations
(`--gguf-activations int8`). Where the blocks are interleaved (AVX-512 VNNI)
both run every row count on them; elsewhere the default runs prefill rows on the float linears it keeps, and the
blocks asked for on weights dequantized per call.

For each, on the embedded model (or `--model-path`): the time of a prefill of `--prefill-len` tokens (one new token)
and of a decode step at a `--context-len` context (generating `--decode-tokens` tokens, less the time of the first),
medians over `--repeats` rounds whose order alternates, and whether the greedy ids of 8 prompts equal the float path's.
The blocks are the default where `model_runner/cpu/gguf_default.py`'s ISA table names this CPU; the script puts this
CPU in the table so it always measures that configuration.

With `--rows`, also every projection of the model (120 on the embedded one, cold in the caches as in a decode
step) at each row count on the default's blocks, on the int8 activations' blocks and on the float path's linear of
the same name (packed as that path packs it), which places `DENSE_FROM` for blocks that are not interleaved
(model_runner/cpu/gguf_linear.py).

    python benchmarks/gguf_default.py --rows 1,2,4,8,16,32 --json docs/results/gguf_default_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu import gguf_default
from radixserve.model_runner.cpu.gguf_linear import GGUFLinear
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import greedy_generate
from radixserve.runtime.wire.server_args import ServerArgs

# label -> (`--quantization`, `--gguf-activations`)
CONFIGS = {"float path": ("none", "float32"), "blocks by default": (None, "float32"), "blocks asked": ("gguf", "float32"),
           "blocks, int8 activations": ("gguf", "int8")}


def projections_at(runner: ModelRunner, int8_runner: ModelRunner, float_runner: ModelRunner, rows: int,
                   repeats: int) -> dict:
    """Every block projection of `runner` once at `rows` rows, on its blocks, on `int8_runner`'s blocks (int8
    activations) and on `float_runner`'s linear of the same name, in rotating order: medians in ms."""
    int8_modules, float_modules = dict(int8_runner.model.named_modules()), dict(float_runner.model.named_modules())
    triples = [(module, int8_modules[name], float_modules[name]) for name, module in runner.model.named_modules()
               if isinstance(module, GGUFLinear) and name in float_modules and name != "logits_head"]
    inputs = {linear.in_features: torch.randn(rows, linear.in_features) for linear, _, _ in triples}
    blocks_op = torch.ops.radixserve_cpu.gguf_linear
    kinds = ["blocks", "int8", "float"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for repeat in range(3 * repeats + 1):
        for kind in kinds[repeat % 3:] + kinds[:repeat % 3]:
            start = time.perf_counter()
            for linear, int8, dense in triples:
                x = inputs[linear.in_features]
                if kind == "float":
                    dense(x)
                else:
                    blocks = linear if kind == "blocks" else int8
                    blocks_op(x, blocks.blocks, blocks.kernel_type, blocks.bias, blocks.activation_bits)
            times[kind].append(time.perf_counter() - start)
    return {"rows": rows, **{f"{kind}_ms": 1e3 * statistics.median(times[kind][1:]) for kind in kinds}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="a GGUF model (default: the embedded one)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=65)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--rows", default="", help="comma-separated row counts for the per-projection crossover")
    parser.add_argument("--json", default=None, help="write the JSON record here")
    args = parser.parse_args()

    gguf_default.GGUF_DEFAULT_ISA_FLAGS = tuple(cpu_build.cpu_isa().split(","))
    model = {} if args.model_path is None else {"model_path": args.model_path}
    runners = {label: ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", quantization=quantization, gguf_activations=activations, max_total_tokens=8192,
        max_running_requests=8, **model)))
        for label, (quantization, activations) in CONFIGS.items()}
    generator = torch.Generator().manual_seed(0)
    vocab = runners["float path"].model_config.vocab_size
    long = [torch.randint(100, vocab - 100, (args.prefill_len,), generator=generator).tolist()]
    short = [torch.randint(100, vocab - 100, (args.context_len,), generator=generator).tolist()]
    prompts = [torch.randint(100, vocab - 100, (32,), generator=generator).tolist() for _ in range(8)]
    for runner in runners.values():  # first calls pay oneDNN's and the kernels' set-up
        greedy_generate(runner, long, 2, stop_token_ids=[])

    times: dict[str, dict[str, list[float]]] = {label: {"prefill": [], "decode": []} for label in runners}
    for repeat in range(args.repeats):
        order = list(runners.items())
        for label, runner in (order if repeat % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            greedy_generate(runner, long, 1, stop_token_ids=[])
            times[label]["prefill"].append(time.perf_counter() - start)
            start = time.perf_counter()
            greedy_generate(runner, short, 1, stop_token_ids=[])
            first = time.perf_counter() - start
            start = time.perf_counter()
            greedy_generate(runner, short, args.decode_tokens, stop_token_ids=[])
            times[label]["decode"].append((time.perf_counter() - start - first) / (args.decode_tokens - 1))
    reference = greedy_generate(runners["float path"], prompts, 32, stop_token_ids=[])
    rows = []
    for label, runner in runners.items():
        ids = reference if label == "float path" else greedy_generate(runner, prompts, 32, stop_token_ids=[])
        rows.append({"config": label, "prefill_ms": 1e3 * statistics.median(times[label]["prefill"]),
                     "decode_step_ms": 1e3 * statistics.median(times[label]["decode"]),
                     "prompts_with_the_float_paths_ids": sum(a == b for a, b in zip(ids, reference)),
                     "prefill_ms_each": [round(1e3 * t, 1) for t in times[label]["prefill"]],
                     "decode_step_ms_each": [round(1e3 * t, 2) for t in times[label]["decode"]]})

    crossover = [projections_at(runners["blocks by default"], runners["blocks, int8 activations"],
                                runners["float path"], int(m), args.repeats)
                 for m in args.rows.split(",") if m]
    record = {"benchmark": "gguf default", "cpu_isa": cpu_build.cpu_isa(), "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "args": vars(args), "rows": rows, "crossover": crossover}
    print(f"CPU ISA {record['cpu_isa']}; {record['threads']} threads; load average "
          f"{' '.join(f'{x:.2f}' for x in record['load_average'])}")
    print(f"{'config':<26} {'prefill ' + str(args.prefill_len) + ' (ms)':>18} "
          f"{'decode step at ' + str(args.context_len) + ' (ms)':>26} {'float ids kept':>15}")
    for row in rows:
        print(f"{row['config']:<26} {row['prefill_ms']:>18.1f} {row['decode_step_ms']:>26.2f} "
              f"{row['prompts_with_the_float_paths_ids']:>12} / {len(prompts)}")
    if crossover:
        print(f"\n{'rows':>5} {'blocks (ms)':>12} {'int8 (ms)':>10} {'float (ms)':>11}   all projections once")
        for row in crossover:
            print(f"{row['rows']:>5} {row['blocks_ms']:>12.2f} {row['int8_ms']:>10.2f} {row['float_ms']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
