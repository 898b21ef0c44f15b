"""A decode step's matrix products at small batch: cuBLAS (`F.linear`) against the skinny Triton kernel.

    # Llama-3.1-8B shape, bf16, on a GPU:
    python benchmarks/skinny_gemm.py --config benchmarks/configs/llama-3.1-8b.json --rows 1,2,4,8,16
    # a smoke run of the script itself on the CPU (Triton interpreter; the times mean nothing):
    python benchmarks/skinny_gemm.py --device cpu --rows 1 --hidden 64 --intermediate 128 --vocab 256 \
        --heads 4 --kv-heads 2 --layers 1 --iters 1 --repeats 1

For each weight shape of one decoder layer (fused qkv, o, fused gate/up, down) and the LM head, and each row count,
`--iters` products are captured in one CUDA graph and replayed `--repeats` times (CUDA events; the median per
product is reported, launch gaps included, as inside a captured decode step). The products cycle through enough
distinct copies of the weight that none is served from L2. "GB/s" is the weight's bytes over the time; the step
rows add the products up for one decode step (every layer, plus the LM head). "max err" is the largest absolute
difference from a float64 product, against cuBLAS's own.

Prints a table and writes JSON to `--out` (default $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

L2_BYTES = 64 << 20  # more than the H100/H200's 50 MB L2


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a config.json to take the shape from (overrides below)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", type=int_list, default=[1, 2, 4, 8, 16])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=20, help="products per timed graph")
    parser.add_argument("--repeats", type=int, default=15, help="timed replays; the median is reported")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="skinny_gemm", help="output file name: <tag>.json")
    args = parser.parse_args(argv)
    if args.config:
        config = json.loads(Path(args.config).read_text())
        args.hidden = config["hidden_size"]
        args.intermediate = config["intermediate_size"]
        args.heads = config["num_attention_heads"]
        args.kv_heads = config.get("num_key_value_heads", args.heads)
        args.head_dim = config.get("head_dim")
        args.vocab = config["vocab_size"]
        args.layers = config["num_hidden_layers"]
    args.head_dim = args.head_dim or args.hidden // args.heads
    return args


def weight_shapes(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, products per decode step)."""
    qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
    return {
        "qkv": (qkv, args.hidden, args.layers),
        "o": (args.hidden, args.heads * args.head_dim, args.layers),
        "gate_up": (2 * args.intermediate, args.hidden, args.layers),
        "down": (args.hidden, args.intermediate, args.layers),
        "lm_head": (args.vocab, args.hidden, 1),
    }


def time_per_call(calls: list[Callable[[], object]], device: torch.device, repeats: int) -> float:
    """Median microseconds per call of `calls`, replayed as one CUDA graph (on the CPU: wall time)."""
    if device.type != "cuda":
        started = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - started) * 1e6 / len(calls)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up (the autotuner times its configurations here)
            call()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def bench_shape(name: str, n: int, k: int, rows: int, args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> dict:
    from radixserve.kernels.skinny_gemm import skinny_gemm

    generator = torch.Generator(device="cpu").manual_seed(n * 31 + k + rows)
    weight_bytes = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, -(-L2_BYTES // weight_bytes)) if device.type == "cuda" else 1
    weights = [(torch.randn(n, k, generator=generator) * k ** -0.5).to(device=device, dtype=dtype)
               for _ in range(copies)]
    x = torch.randn(rows, k, generator=generator).to(device=device, dtype=dtype)
    reference = x.double() @ weights[0].double().T
    cublas_err = (F.linear(x, weights[0]).double() - reference).abs().max().item()
    skinny_err = (skinny_gemm(x, weights[0]).double() - reference).abs().max().item()
    calls = args.iters * copies if device.type == "cuda" else args.iters
    cublas_us = time_per_call([lambda w=weights[i % copies]: F.linear(x, w) for i in range(calls)], device,
                              args.repeats)
    skinny_us = time_per_call([lambda w=weights[i % copies]: skinny_gemm(x, w) for i in range(calls)], device,
                              args.repeats)
    del weights
    return dict(name=name, n=n, k=k, rows=rows, cublas_us=cublas_us, skinny_us=skinny_us,
                cublas_gbs=weight_bytes / cublas_us / 1e3, skinny_gbs=weight_bytes / skinny_us / 1e3,
                cublas_max_err=cublas_err, skinny_max_err=skinny_err)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = weight_shapes(args)
    results, steps = [], []
    print(f"{'shape':>8} {'N':>7} {'K':>6} {'rows':>4} {'cuBLAS us':>10} {'skinny us':>10} {'cuBLAS GB/s':>11} "
          f"{'skinny GB/s':>11} {'speed-up':>8} {'max err c/s':>16}")
    for rows in args.rows:
        step = dict(rows=rows, cublas_us=0.0, skinny_us=0.0)
        for name, (n, k, per_step) in shapes.items():
            r = bench_shape(name, n, k, rows, args, device, dtype)
            results.append(r)
            step["cublas_us"] += r["cublas_us"] * per_step
            step["skinny_us"] += r["skinny_us"] * per_step
            print(f"{name:>8} {n:>7} {k:>6} {rows:>4} {r['cublas_us']:>10.2f} {r['skinny_us']:>10.2f} "
                  f"{r['cublas_gbs']:>11.0f} {r['skinny_gbs']:>11.0f} {r['cublas_us'] / r['skinny_us']:>7.2f}x "
                  f"{r['cublas_max_err']:>7.1e}/{r['skinny_max_err']:.1e}")
        steps.append(step)
    print(f"\n{'rows':>4} {'step GEMMs cuBLAS ms':>21} {'skinny ms':>10} {'speed-up':>8}")
    for step in steps:
        print(f"{step['rows']:>4} {step['cublas_us'] / 1e3:>21.3f} {step['skinny_us'] / 1e3:>10.3f} "
              f"{step['cublas_us'] / step['skinny_us']:>7.2f}x")
    env = dict(python=platform.python_version(), torch=torch.__version__, device=str(device), dtype=args.dtype)
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")
    with open(path, "w") as f:
        json.dump(dict(env=env, args=vars(args), shapes=results, steps=steps), f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
