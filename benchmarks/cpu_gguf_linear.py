"""Linear layers on GGUF blocks on the CPU (kernels/cpu_gguf_linear.cpp) against the float32 paths, on the embedded
model's projection shapes: where `GGUFLinear` should switch from the in-register kernel to dequantizing the whole
weight (`DEQUANTIZE_FROM`, model_runner/cpu/gguf_linear.py).

    python benchmarks/cpu_gguf_linear.py --threads 2
    python benchmarks/cpu_gguf_linear.py --threads 1 --rows 1 8 32 --types Q4_1 --out gguf.json

One "forward" is the 120 projections of SmolLM2-135M (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, each layer its own random weights, quantized with gguf-py, so nothing stays in the core's caches from
one layer to the next as in a real forward); the LM head (49152x576) is timed on its own. Median milliseconds of
`--repeats` forwards after a warm-up, per path:

- `blocks`: `torch.ops.radixserve_cpu.gguf_linear` on the blocks (dequantized in registers);
- `int8`: the same op with `activation_bits` 8, the activations rounded to int8 per block of 32 and multiplied in
  integers (kernels/cpu_gguf_q8.h, `--gguf-activations int8`);
- `dequantize`: `gguf_dequantize` of the whole weight, then `F.linear`;
- `float32`: `F.linear` on the float32 weight (what `--dtype float32` reads, before its own kernels).

Prints a table with the CPU's ISA flags and writes a JSON record (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import _srcpath  # noqa: F401
import numpy as np
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)
HEAD_SHAPE = (49152, 576)


def quantized(shape: tuple[int, int], ggml_type, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from gguf.quants import dequantize, quantize

    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).numpy() * 0.02
    blocks = quantize(values, ggml_type)
    return torch.from_numpy(np.array(blocks, copy=True)), torch.from_numpy(np.array(dequantize(blocks, ggml_type)))


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def measure(type_name: str, rows: list[int], repeats: int) -> list[dict]:
    from gguf import GGMLQuantizationType

    ggml_type = GGMLQuantizationType[type_name]
    layers = [quantized(shape, ggml_type, seed=i * 4 + j) for i in range(LAYERS) for j, shape in enumerate(LAYER_SHAPES)]
    head = quantized(HEAD_SHAPE, ggml_type, seed=10_000)
    paths = {
        "blocks": lambda x, blocks, weight: torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(ggml_type), None),
        "int8": lambda x, blocks, weight: torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(ggml_type), None, 8),
        "dequantize": lambda x, blocks, weight: F.linear(x, torch.ops.radixserve_cpu.gguf_dequantize(blocks,
                                                                                                      int(ggml_type))),
        "float32": lambda x, blocks, weight: F.linear(x, weight),
    }
    records = []
    print(f"{type_name}: {'rows':>5} " + " ".join(f"{p + ' fwd':>15} {p + ' head':>15}" for p in paths))
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in {shape[1] for shape in LAYER_SHAPES}}
        record = {"type": type_name, "rows": m}
        for name, path in paths.items():
            record[f"{name}_forward_ms"] = median_ms(
                lambda: [path(inputs[w.shape[1]], b, w) for b, w in layers], repeats)
            record[f"{name}_head_ms"] = median_ms(lambda: path(inputs[HEAD_SHAPE[1]], *head), repeats)
        records.append(record)
        print(f"{type_name}: {m:>5} " + " ".join(f"{record[p + '_forward_ms']:>15.2f} {record[p + '_head_ms']:>15.2f}"
                                               for p in paths))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 128])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"], choices=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    if not cpu_build.load():
        raise SystemExit("the CPU kernels did not build (see the log)")
    torch.set_num_threads(args.threads)
    print(f"ISA {cpu_build.cpu_isa()}, torch {torch.__version__}, {args.threads} thread(s); milliseconds, median of "
          f"{args.repeats}")
    records = [r for type_name in args.types for r in measure(type_name, args.rows, args.repeats)]
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "cpu gguf linear", "isa": cpu_build.cpu_isa(),
                                              "torch": torch.__version__, "threads": args.threads,
                                              "records": records}, indent=1))


if __name__ == "__main__":
    main()
