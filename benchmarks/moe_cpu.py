"""The routed experts of one mixture-of-experts layer on the CPU: the runtime's two paths (model_runner/moe/grouped.py)
against Hugging Face's per-expert loop and against gathering each pair's expert weights for one batched matmul.

    python benchmarks/moe_cpu.py --threads 2
    python benchmarks/moe_cpu.py --threads 1 --shapes qwen3-30b-a3b --tokens 1 4 16 --dtypes bfloat16 --out moe.json

For each layer shape, dtype and token count T, the fastest of `--repeats` rounds after a warm-up, in milliseconds per
call, per path (each round calls every path once, so a busy machine's slow spells fall on all paths alike)
(each computes `sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t))` over each token's top-k experts):

- `loop`: for each expert some token visits, gather its tokens, two `F.linear`s, scale and `index_add_` (the shape of
  Hugging Face's reference, a Python loop of up to E iterations);
- `gather`: `index_select` every (token, slot) pair's expert weights and one `bmm` per projection (copies T*k experts'
  weights; skipped past `--gather-max-pairs` pairs, where the copy alone takes seconds);
- `grouped`: the runtime's path from `SMALL_MAX_PAIRS` pairs, pairs sorted by expert and one `F.grouped_mm` per
  projection on the stacked weights;
- `small`: the runtime's path up to `SMALL_MAX_PAIRS` pairs (`--gather-max-pairs` here), one C++ call
  (`radixserve_cpu::small_experts`) running each visited expert on the small-row linear kernel.

Routing is drawn at random (uniform logits), so the experts visited follow the count a real router spreads over. Every
path's output is checked against `grouped`'s before timing. Prints a table and writes a JSON record (`--out`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import _srcpath  # noqa: F401
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build
from radixserve.model_runner.moe.grouped import grouped_gemm_experts
from radixserve.model_runner.moe.routing import select_experts

# name: (hidden, experts' intermediate, experts, top-k), from the models' published configs.
SHAPES = {
    "tiny": (64, 32, 8, 2),  # the suite's tiny random models
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def loop_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        tokens, slots = torch.where(topk_ids == expert)
        rows = F.linear(silu_and_mul(F.linear(hidden[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, rows.float() * topk_weights[tokens, slots, None])
    return out.to(hidden.dtype)


def gathered_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    rows = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)
    gate_up = torch.bmm(w13.index_select(0, flat), rows).squeeze(-1)
    down = torch.bmm(w2.index_select(0, flat), silu_and_mul(gate_up).unsqueeze(-1)).squeeze(-1)
    return (down.float().view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


def small_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    return torch.ops.radixserve_cpu.small_experts(hidden, w13, w2, topk_weights, topk_ids)


PATHS: dict[str, Callable[..., torch.Tensor]] = {"loop": loop_experts, "gather": gathered_experts,
                                                 "grouped": grouped_gemm_experts, "small": small_experts}


def best_ms(calls: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """The fastest of `repeats` rounds per call, in milliseconds; each round runs every call once."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) * 1e3 for name, values in times.items()}


def run_shape(name: str, dtype: torch.dtype, tokens: list[int], args) -> list[dict]:
    hidden_size, intermediate, num_experts, top_k = SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator) * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, intermediate, generator=generator) * 0.02).to(dtype)
    records = []
    for num_tokens in tokens:
        hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
        weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k,
                                      "softmax_topk", True)
        reference = grouped_gemm_experts(hidden, w13, w2, weights, ids).float()
        record = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "tokens": num_tokens,
                  "experts_hit": int(ids.unique().numel()), "ms": {}}
        calls = {}
        for path in args.paths:
            if path in ("gather", "small") and num_tokens * top_k > args.gather_max_pairs:
                continue
            fn = PATHS[path]
            out = fn(hidden, w13, w2, weights, ids).float()
            error = ((out - reference).abs().max() / reference.abs().max()).item()
            assert error < (1e-4 if dtype == torch.float32 else 5e-2), f"{path}: relative error {error}"
            calls[path] = lambda fn=fn: fn(hidden, w13, w2, weights, ids)
        record["ms"] = best_ms(calls, args.repeats)
        records.append(record)
        times = "  ".join(f"{p} {record['ms'][p]:9.3f}" for p in args.paths if p in record["ms"])
        fastest = "small" if "small" in record["ms"] else "grouped"
        speedup = record["ms"]["loop"] / record["ms"][fastest] if {"loop", fastest} <= set(record["ms"]) else 0
        print(f"{name:>18} {record['dtype']:>8} T={num_tokens:<4} hit {record['experts_hit']:>3}/{num_experts:<3} "
              f"{times}   loop/{fastest} {speedup:5.2f}x", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--gather-max-pairs", type=int, default=64)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "small" in args.paths and not cpu_build.load():
        raise SystemExit("the small path needs radixserve's C++ CPU kernels, which could not be built here")
    print(f"CPU ISA {cpu_build.cpu_isa()}; torch {torch.__version__}, {args.threads} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; milliseconds per call (best of {args.repeats} rounds)")
    records = []
    with torch.inference_mode():
        for name in args.shapes:
            for dtype_name in args.dtypes:
                records += run_shape(name, getattr(torch, dtype_name), args.tokens, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": args.threads, "torch": torch.__version__,
                                              "cpu_isa": cpu_build.cpu_isa(), "records": records}, indent=2))


if __name__ == "__main__":
    main()
