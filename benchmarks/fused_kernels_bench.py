"""The decoder's elementwise blocks, torch path vs fused Triton kernels, per op, at decode batch sizes.

    # Llama-3.1-8B shape (hidden 4096, 32/8 heads of 128, intermediate 14336), bf16, on a GPU:
    python benchmarks/fused_kernels_bench.py --config benchmarks/configs/llama-3.1-8b.json --batch-sizes 1,8,64
    # a smoke run of the script itself on the CPU (Triton interpreter; the times mean nothing):
    python benchmarks/fused_kernels_bench.py --device cpu --batch-sizes 1 --iters 2 --repeats 1 --hidden 256

Ops, each at the shapes one decoder layer gives it: `add_rms_norm` (residual add + RMSNorm, twice per layer),
`rms_norm` (no residual; the first layer's input norm), `silu_and_mul` over the fused gate/up output,
`rotary` of q and k read from a fused qkv output at positions below `--context-len`, and `kv_store`, the write
of the new tokens' K and V into a layer's KV buffers. "torch" is the reference path of
`model_runner/layers.py` (and the indexed writes of `TokenToKVPool` on the CPU), "fused" the kernels of
`radixserve.kernels`.

Timing, on a GPU: `--iters` calls of one op are captured in one CUDA graph and replayed `--repeats` times,
each replay timed with CUDA events; the table shows the median per call, i.e. the device time one call adds
to a captured decode step, launch gaps included. "eager" columns time the same calls issued one by one
(CUDA events around `--iters` calls), as prefill or a graph-less decode runs them. The last rows add the ops
up for one decode step (every layer's ops, plus the final norm). "max diff" is the largest absolute
difference between the two paths' outputs on the same inputs.

Prints a table and writes JSON to `--out` (default $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout
from cuda_graph_timing import time_graph  # noqa: E402

import torch  # noqa: E402  (torch does not import triton; the kernels are imported once the device is known)

# How many times one decoder layer runs each op (the final norm adds one add_rms_norm per step).
CALLS_PER_LAYER = {"add_rms_norm": 2, "rms_norm": 0, "silu_and_mul": 1, "rotary": 1, "kv_store": 1}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a config.json to take the shape from (overrides below)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 64])
    parser.add_argument("--context-len", type=int, default=1024, help="positions and KV slots per request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=50, help="calls per timed graph / eager run")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="fused_kernels", help="output file name: <tag>.json")
    args = parser.parse_args(argv)
    if args.config:
        config = json.loads(Path(args.config).read_text())
        args.hidden = config["hidden_size"]
        args.intermediate = config["intermediate_size"]
        args.heads = config["num_attention_heads"]
        args.kv_heads = config.get("num_key_value_heads", args.heads)
        args.head_dim = config.get("head_dim") or args.hidden // args.heads
        args.layers = config["num_hidden_layers"]
        args.rope_theta = config.get("rope_theta", args.rope_theta)
        args.rope_scaling = config.get("rope_scaling")
    else:
        args.rope_scaling = None
    return args


# ---- inputs and the two implementations of each op ---------------------------------------------------

def build_cases(args: argparse.Namespace, batch: int, device: torch.device, dtype: torch.dtype
                ) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (torch call, fused call), both closed over the same inputs and returning their outputs."""
    from radixserve.kernels import kv_store
    from radixserve.model_runner.layers import TORCH_OPS, RotaryEmbedding, fused_ops

    fused = fused_ops()
    generator = torch.Generator(device="cpu").manual_seed(args.seed + batch)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    eps = 1e-5
    hidden = randn(batch, args.hidden)
    residual = randn(batch, args.hidden)
    weight = (1 + 0.1 * randn(args.hidden)).contiguous()
    gate_up = randn(batch, 2 * args.intermediate)

    q_size, kv_size = args.heads * args.head_dim, args.kv_heads * args.head_dim
    qkv = randn(batch, q_size + 2 * kv_size)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(batch, args.heads, args.head_dim)
    k = k.view(batch, args.kv_heads, args.head_dim)
    v = v.view(batch, args.kv_heads, args.head_dim)
    rotary = RotaryEmbedding(args.head_dim, args.context_len, args.rope_theta, args.rope_scaling)
    cos, sin = rotary.cos.to(device), rotary.sin.to(device)
    positions = torch.randint(0, args.context_len, (batch,), generator=generator).to(device)

    # One layer's KV buffers (one pair per path) sized for `batch` requests of `context_len` tokens; each
    # request writes its new token at a distinct slot.
    num_slots = batch * args.context_len + 1
    buffers = [torch.zeros(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device) for _ in range(4)]
    loc = (torch.randperm(num_slots - 1, generator=generator)[:batch] + 1).to(device)

    def torch_kv_store():
        k_buffer, v_buffer = buffers[0], buffers[1]
        k_buffer[loc] = k
        v_buffer[loc] = v
        return k_buffer, v_buffer

    def fused_kv_store():
        kv_store.store_kv(buffers[2], buffers[3], loc, k, v)
        return buffers[2], buffers[3]

    return {
        "add_rms_norm": (lambda: TORCH_OPS.add_rms_norm(hidden, residual, weight, eps),
                         lambda: fused.add_rms_norm(hidden, residual, weight, eps)),
        "rms_norm": (lambda: TORCH_OPS.rms_norm(hidden, weight, eps),
                     lambda: fused.rms_norm(hidden, weight, eps)),
        "silu_and_mul": (lambda: TORCH_OPS.silu_and_mul(gate_up), lambda: fused.silu_and_mul(gate_up)),
        "rotary": (lambda: TORCH_OPS.rotary(positions, q, k, cos, sin),
                   lambda: fused.rotary(positions, q, k, cos, sin)),
        "kv_store": (torch_kv_store, fused_kv_store),
    }


def max_difference(first, second) -> float:
    firsts = first if isinstance(first, tuple) else (first,)
    seconds = second if isinstance(second, tuple) else (second,)
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(firsts, seconds))


# ---- timing ------------------------------------------------------------------------------------------

def time_graph_us(fn: Callable, iters: int, repeats: int) -> float:
    """Median device time per call of `fn`, `iters` calls captured in one CUDA graph."""
    return time_graph([fn] * iters, repeats)


def time_eager_us(fn: Callable, iters: int, repeats: int, on_gpu: bool) -> float:
    """Median time per call of `fn` issued eagerly: CUDA events on a GPU, the wall clock elsewhere."""
    fn()
    times = []
    for _ in range(repeats):
        if on_gpu:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - began) * 1e6 / iters)
    return statistics.median(times)


# ---- report ------------------------------------------------------------------------------------------

def step_rows(rows: list[dict], layers: int) -> list[dict]:
    """Per batch size, the ops of one decode step added up: every layer's calls plus the final norm."""
    totals = []
    for batch in sorted({row["batch"] for row in rows}):
        mine = [row for row in rows if row["batch"] == batch]
        total = {"op": f"step ({layers} layers)", "batch": batch}
        for key in ("torch_graph_us", "fused_graph_us", "torch_eager_us", "fused_eager_us"):
            values = [row[key] * (CALLS_PER_LAYER[row["op"]] * layers + (row["op"] == "add_rms_norm"))
                      for row in mine if row.get(key) is not None]
            total[key] = sum(values) if values else None
        totals.append(total)
    return totals


def print_table(rows: list[dict]) -> None:
    def cell(value: Optional[float]) -> str:
        return f" {value:10.2f}" if value is not None else f" {'-':>10}"

    print(f"{'op':<18}{'batch':>6}{'torch us':>11}{'fused us':>11}{'speedup':>10}"
          f"{'torch eag':>11}{'fused eag':>11}{'max diff':>10}")
    for row in rows:
        torch_us, fused_us = row.get("torch_graph_us"), row.get("fused_graph_us")
        if torch_us is None:  # no graphs (CPU): compare the eager times
            torch_us, fused_us = row["torch_eager_us"], row["fused_eager_us"]
        speedup = f"{torch_us / fused_us:9.2f}x" if fused_us else f"{'-':>10}"
        diff = row.get("max_diff")
        print(f"{row['op']:<18}{row['batch']:>6}{cell(row.get('torch_graph_us'))}{cell(row.get('fused_graph_us'))}"
              f"{speedup:>9}{cell(row['torch_eager_us'])}{cell(row['fused_eager_us'])}"
              + (f"{diff:10.2e}" if diff is not None else ""))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # The kernels can only run under the interpreter on the CPU; it must be on before triton loads.
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": str(device), "dtype": args.dtype}
    if on_gpu:
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    shape = {key: getattr(args, key) for key in
             ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers", "context_len")}
    print(f"[fused_kernels] {json.dumps(env)}\n[fused_kernels] shape {json.dumps(shape)}", flush=True)

    rows: list[dict] = []
    for batch in args.batch_sizes:
        cases = build_cases(args, batch, device, dtype)
        for op, (torch_fn, fused_fn) in cases.items():
            row = {"op": op, "batch": batch}
            row["max_diff"] = max_difference(torch_fn(), fused_fn())
            for name, fn in (("torch", torch_fn), ("fused", fused_fn)):
                row[f"{name}_eager_us"] = time_eager_us(fn, args.iters, args.repeats, on_gpu)
                row[f"{name}_graph_us"] = time_graph_us(fn, args.iters, args.repeats) if on_gpu else None
            rows.append(row)
            print(f"[fused_kernels] {json.dumps(row)}", flush=True)
        del cases
        if on_gpu:
            torch.cuda.empty_cache()
    totals = step_rows(rows, args.layers)

    print(f"\n== elementwise blocks, torch vs fused, {args.dtype} on {env.get('gpu', str(device))} ==")
    print("per call (us); 'torch us' / 'fused us' inside CUDA graphs, 'eag' issued eagerly\n")
    print_table(rows + totals)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")
    with open(path, "w") as handle:
        json.dump({"env": env, "shape": shape, "iters": args.iters, "repeats": args.repeats,
                   "ops": rows, "per_step": totals}, handle, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
