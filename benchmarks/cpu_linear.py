"""Small-row linear layers on the CPU: the C++ kernel (kernels/cpu_linear.cpp) against `F.linear` and the packed
oneDNN path, on the embedded model's projection shapes.

    python benchmarks/cpu_linear.py --threads 1
    python benchmarks/cpu_linear.py --threads 2 --rows 1 2 4 8 --dtypes float32
    python benchmarks/cpu_linear.py --threads 2 --rows 8 32 64 128 256 --dtypes bfloat16
    python benchmarks/cpu_linear.py --threads 2 --rows 256 512 1024 --dtypes bfloat16 --paths packed F.linear amx gemm

One "forward" is the 120 projections of SmolLM2-135M (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, each layer its own random weights, so nothing stays in the core's caches from one layer to the next
as in a real forward); the LM head (49152x576) is timed on its own. For each dtype and row count M, the median
milliseconds of `--repeats` forwards after a warm-up, per path:

- `F.linear`: torch's op on the plain weight (float32: MKL/oneDNN; bfloat16: oneDNN, reordering the weight on
  every call);
- `packed`: `torch.ops.mkldnn._linear_pointwise` on a weight packed once (model_runner/cpu/small_batch.py for
  float32, model_runner/cpu/packed.py for bfloat16);
- `kernel`: `torch.ops.radixserve_cpu.small_linear` on the plain weight;
- `panel` (float32 on AVX-512, bfloat16 on AVX512_BF16): `torch.ops.radixserve_cpu.panel_linear` on the weight
  packed in column panels (model_runner/cpu/panel_linear.py);
- `amx` (bfloat16, where the CPU and the OS grant AMX tiles): `torch.ops.radixserve_cpu.amx_linear` on the weight
  packed for the tiles (model_runner/cpu/amx_linear.py), the loop for decode batches;
- `gemm` (same condition): `torch.ops.radixserve_cpu.amx_gemm` on the same packed weight, the loop for prefill.

`--paths` keeps only the named paths (the small-row kernel takes seconds at prefill row counts). A forward at
prefill row counts also prints the 120 projections' TFLOP/s per path. `--by-projection` also times each kind of
projection on its own (its 30 layers' weights in turn):

    python benchmarks/cpu_linear.py --threads 2 --rows 65 512 2048 --paths packed F.linear --by-projection

`--hot` gives every layer the first layer's weights, so they stay in the caches: the difference to a plain run is
the time spent waiting for memory.

Prints a table with the CPU's ISA flags and writes a JSON record (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import _srcpath  # noqa: F401
import roofline
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.amx_linear import pack_for_tiles
from radixserve.model_runner.cpu.panel_linear import pack_panels

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the names of LAYER_SHAPES
HEAD_SHAPE = (49152, 576)
CPU = torch.device("cpu")


def medians_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """name -> median milliseconds of `repeats` calls after one warm-up each, the paths alternated call by call (so a
    slow minute of a shared machine falls on all of them alike)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(roofline.time_ms(call, CPU))
    return {name: statistics.median(found) for name, found in times.items()}


PATHS = ("F.linear", "packed", "kernel", "panel", "amx", "gemm")


def paths(weights: list[torch.Tensor], names: tuple[str, ...]) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """name -> call(x, index of the weight) for the paths of `names` that run here; the packed copies are made
    here, once."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    kernel = torch.ops.radixserve_cpu.small_linear
    found = {
        "F.linear": lambda x, i: F.linear(x, weights[i]),
        "packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], ""),
        "kernel": lambda x, i: kernel(x, weights[i], None),
    }
    if "panel" in names and torch.ops.radixserve_cpu.panel_linear_supported(weights[0].dtype):
        panels = [pack_panels(w) for w in weights]
        found["panel"] = lambda x, i: torch.ops.radixserve_cpu.panel_linear(x, panels[i], None)
    if weights[0].dtype == torch.bfloat16 and torch.ops.radixserve_cpu.amx_linear_ready():
        tiles = [pack_for_tiles(w) for w in weights]
        found["amx"] = lambda x, i: torch.ops.radixserve_cpu.amx_linear(x, tiles[i], None)
        found["gemm"] = lambda x, i: torch.ops.radixserve_cpu.amx_gemm(x, tiles[i], None)
    return {name: call for name, call in found.items() if name in names}


def measure(dtype: torch.dtype, rows: list[int], repeats: int, names: tuple[str, ...],
            by_projection: bool = False, hot: bool = False) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS
    weights = [(torch.randn(n, k, generator=generator) * 0.05).to(dtype) for n, k in shapes[:4 if hot else None]]
    weights = weights * (LAYERS if hot else 1)  # hot: every layer the first one's weights, kept in the caches
    head = [(torch.randn(*HEAD_SHAPE, generator=generator) * 0.05).to(dtype)]
    layer_paths, head_paths = paths(weights, names), paths(head, names)
    flops = 2 * sum(n * k for n, k in shapes)  # per row of a forward
    records = []
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator).to(dtype) for k in {k for _, k in LAYER_SHAPES}}
        record = dict(dtype=str(dtype).removeprefix("torch."), rows=m)
        forward = medians_ms({name: (lambda call: lambda: [call(inputs[shape[1]], i) for i, shape in enumerate(
            shapes)])(call) for name, call in layer_paths.items()}, repeats)
        head_ms = medians_ms({name: (lambda call: lambda: call(inputs[HEAD_SHAPE[1]], 0))(call)
                              for name, call in head_paths.items()}, repeats)
        record.update({f"{name}_forward_ms": ms for name, ms in forward.items()})
        record.update({f"{name}_head_ms": ms for name, ms in head_ms.items()})
        for j, projection in enumerate(PROJECTIONS if by_projection else ()):
            own = [i for i in range(len(shapes)) if i % len(LAYER_SHAPES) == j]
            split = medians_ms({name: (lambda call: lambda: [call(inputs[shapes[i][1]], i) for i in own])(call)
                                for name, call in layer_paths.items()}, repeats)
            record.update({f"{name}_{projection}_ms": ms for name, ms in split.items()})
        records.append(record)
        print(f"{record['dtype']:>9} M={m:>2}  forward: " + "  ".join(
            f"{name} {record[f'{name}_forward_ms']:6.1f}" for name in layer_paths) + "   head: " + "  ".join(
            f"{name} {record[f'{name}_head_ms']:5.2f}" for name in head_paths) + "   TFLOP/s: " + "  ".join(
            f"{name} {flops * m / record[f'{name}_forward_ms'] / 1e9:4.2f}" for name in layer_paths), flush=True)
        for projection in PROJECTIONS if by_projection else ():
            print(f"{'':>9} {'':>4}  {projection:>8}: " + "  ".join(
                f"{name} {record[f'{name}_{projection}_ms']:6.2f}" for name in layer_paths), flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(1, 13)))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="time only these paths")
    parser.add_argument("--by-projection", action="store_true", help="also time each kind of projection alone")
    parser.add_argument("--hot", action="store_true",
                        help="every layer runs the first layer's weights, which stay in the caches: against the "
                             "default, what waiting for memory costs")
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    if not cpu_build.load():
        raise SystemExit("the CPU kernels did not build (see the log)")
    torch.set_num_threads(args.threads)
    print(f"ISA {cpu_build.cpu_isa()} (torch: {torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{args.threads} thread(s); milliseconds, median of {args.repeats}")
    records = [r for dtype in args.dtypes for r in measure(getattr(torch, dtype), args.rows, args.repeats,
                                                                     tuple(args.paths), args.by_projection,
                                                                     args.hot)]
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu small-row linear", "isa": cpu_build.cpu_isa(), "torch": torch.__version__,
            "threads": args.threads, "hot": args.hot, "records": records}, indent=1))


if __name__ == "__main__":
    main()
