"""Tune the fused MoE kernels' block sizes (kernels/fused_moe_configs.py) for one layer shape on the GPU at hand, and
set the decode path against the aligned path:

    python benchmarks/tune_fused_moe.py                       # Qwen3-30B-A3B: 128 experts, top-8, I=768, H=2048, bf16
    python benchmarks/tune_fused_moe.py --experts 64 --top-k 8 --intermediate 1408 --hidden 2048 --tokens 1,8,64
    python benchmarks/tune_fused_moe.py --tokens 1,8 --no-aligned-search   # decode against aligned only
    python benchmarks/tune_fused_moe.py --tokens 1,4,8,16,32 --no-aligned-search --compare-all   # where to switch

Aligned path: for each token count, every config of the search space runs `fused_moe(path="aligned")` on random
routed inputs (softmax top-k over random router logits), timed with CUDA events after warm-up (median of
`--repeats`), and the fastest is kept when it also matches the default config's output (max abs difference within
bf16 rounding). Prints, per token count, the default config's time, the best time and the best config; then the
rows to paste into `TUNED` (consecutive token counts with the same best config merged), each token count's row
covering up to the next one. `--no-aligned-search` times the table's config only.

Decode path, at the token counts of `--tokens` that `use_decode_path` sends to it (every one with `--compare-all`, to
check where the threshold should be): every config of `DECODE_SPACE`, and the aligned path's best, timed as device
time in CUDA graphs (each graph holds `GRAPH_CALLS` calls on different routings, so the experts of one call are not
still in L2 for the next, as across the layers of a model); the decode config with the least total time at the token
counts that take the decode path is printed as the `DECODE_TUNED` entry. Beside them, the routing of the same
logits: `select_experts_torch` (the torch form) against the routing kernel, in graphs too. Writes a JSON record
(--out, or $OUT/tune_fused_moe.json when OUT is set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)
from cuda_graph_timing import time_graph

SPACE = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (64, 128), "num_warps": (4, 8),
         "num_stages": (3, 4)}
# The matrix-vector loops feed no tl.dot, which Triton's software pipelining stages loads for: their bytes in flight
# come mostly from BLOCK_K and the number of programs (BLOCK_N), which the space varies rather than num_stages.
DECODE_SPACE = {"BLOCK_N": (8, 16, 32), "BLOCK_K": (128, 256, 512), "DOWN_BLOCK_N": (2, 4, 8),
                "DOWN_BLOCK_K": (128, 256), "num_warps": (4, 8), "num_stages": (3,)}
GRAPH_CALLS = 8


def configs(space: dict = SPACE) -> list[dict[str, int]]:
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def time_config(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)  # microseconds
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768, help="per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-aligned-search", action="store_true", help="time the aligned path's table config only")
    parser.add_argument("--compare-all", action="store_true",
                        help="set the decode path against the aligned one at every token count, to check the threshold")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "tune_fused_moe.json"))
    args = parser.parse_args()

    import torch

    from radixserve.kernels.fused_moe_configs import block_config
    from radixserve.kernels.fused_moe_triton import fused_moe
    from radixserve.model_runner.moe.routing import select_experts_torch

    dtype = getattr(torch, args.dtype)
    E, I, H, k = args.experts, args.intermediate, args.hidden, args.top_k
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=generator) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=generator) * I ** -0.5).to(dtype)
    print(f"GPU {torch.cuda.get_device_name()}; shape experts {E}, top-{k}, intermediate {I}, hidden {H}, {args.dtype}")
    print(f"{'tokens':>7} {'default us':>11} {'best us':>9} {'gain':>6}  best config")
    rows, inputs = [], {}
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        hidden = (torch.randn(num_tokens, H, device="cuda", generator=generator)).to(dtype)
        logits = torch.randn(num_tokens, E, device="cuda", generator=generator).to(dtype)
        weights, ids = select_experts_torch(logits, k, "softmax_topk", renormalize=True)
        inputs[num_tokens] = hidden, logits, weights, ids
        default = block_config(num_tokens, E, I, H, args.dtype)
        reference = fused_moe(hidden, w13, w2, weights, ids, dict(default), path="aligned")
        tolerance = 2e-2 * float(reference.abs().max()) + 1e-3
        default_us = time_config(lambda: fused_moe(hidden, w13, w2, weights, ids, dict(default), path="aligned"),
                                 args.repeats)
        best_us, best = default_us, default
        for config in [] if args.no_aligned_search else configs():
            try:
                out = fused_moe(hidden, w13, w2, weights, ids, dict(config), path="aligned")
            except Exception:  # a config past the GPU's shared memory: skipped
                continue
            if float((out.float() - reference.float()).abs().max()) > tolerance:
                continue
            us = time_config(lambda: fused_moe(hidden, w13, w2, weights, ids, dict(config), path="aligned"),
                             args.repeats)
            if us < best_us:
                best_us, best = us, config
        rows.append({"tokens": num_tokens, "default_us": default_us, "best_us": best_us, "best": best,
                     "default": default})
        print(f"{num_tokens:>7} {default_us:>11.1f} {best_us:>9.1f} {default_us / best_us:>5.2f}x  {best}", flush=True)
    decode = compare_decode_path(args, rows, inputs, w13, w2)

    merged: list[tuple[int, dict]] = []
    for row, following in zip(rows, rows[1:] + [None]):
        cover = (1 << 62) if following is None else following["tokens"] - 1
        if merged and merged[-1][1] == row["best"]:
            merged[-1] = (cover, row["best"])
        else:
            merged.append((cover, row["best"]))
    print(f"\nTUNED[({E}, {I}, {H}, {args.dtype!r})] = [  # {torch.cuda.get_device_name()}")
    for cover, config in merged:
        print(f"    ({cover}, {config}),")
    print("]")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "shape": {"experts": E, "top_k": k, "intermediate": I,
                   "hidden": H, "dtype": args.dtype}, "rows": rows, "table": merged, "decode": decode}, f, indent=2)


def compare_decode_path(args: argparse.Namespace, rows: list[dict], inputs: dict, w13, w2) -> dict:
    """The decode path's search and its comparison with the aligned path's best and with the torch routing, in CUDA
    graphs, at the token counts that take the decode path (module docstring)."""
    import torch

    from radixserve.kernels.fused_moe_configs import decode_config
    from radixserve.kernels.fused_moe_triton import fused_moe, use_decode_path
    from radixserve.kernels.moe_routing import route_topk
    from radixserve.model_runner.moe.routing import select_experts_torch

    E, I, H, k = args.experts, args.intermediate, args.hidden, args.top_k
    decode_counts = [row["tokens"] for row in rows if use_decode_path(row["tokens"], k, E)]
    token_counts = [row["tokens"] for row in rows] if args.compare_all else decode_counts
    if not token_counts:
        return {}
    generator = torch.Generator(device="cuda").manual_seed(1)
    routings = {}  # GRAPH_CALLS routings of each token count's hidden states, each visiting other experts
    for num_tokens in token_counts:
        hidden = inputs[num_tokens][0]
        logits = [torch.randn(num_tokens, E, device="cuda", generator=generator).to(hidden.dtype)
                  for _ in range(GRAPH_CALLS)]
        routings[num_tokens] = hidden, logits, [select_experts_torch(x, k, "softmax_topk", True) for x in logits]

    def moe_calls(num_tokens: int, path: str, config: dict) -> list:
        hidden, _, routed = routings[num_tokens]
        return [lambda w=w, i=i: fused_moe(hidden, w13, w2, w, i, dict(config), path=path) for w, i in routed]

    references = {n: fused_moe(inputs[n][0], w13, w2, inputs[n][2], inputs[n][3], path="aligned")
                  for n in token_counts}
    default = decode_config(E, I, H, args.dtype)
    searched = {}  # config as a tuple of items -> {tokens: graph us}
    for config in [default] + [c for c in configs(DECODE_SPACE) if c != default]:
        times = {}
        for num_tokens in token_counts:
            hidden, _, weights, ids = inputs[num_tokens]
            reference = references[num_tokens]
            try:
                out = fused_moe(hidden, w13, w2, weights, ids, dict(config), path="decode")
            except Exception:  # a config past the GPU's registers or shared memory: skipped
                break
            if float((out.float() - reference.float()).abs().max()) > 2e-2 * float(reference.abs().max()) + 1e-3:
                print(f"decode config {config} differs from the aligned path at {num_tokens} tokens: skipped")
                break
            times[num_tokens] = time_graph(moe_calls(num_tokens, "decode", config), args.repeats)
        else:
            searched[tuple(config.items())] = times
    if not searched:
        print("no decode config ran and matched the aligned path")
        return {"default": default, "rows": []}
    chosen_by = decode_counts or token_counts  # the config is picked for the sizes the decode path runs at
    best = min(searched, key=lambda key: sum(searched[key][n] for n in chosen_by))
    print(f"\ndecode path against aligned, device time per call in CUDA graphs (us), {GRAPH_CALLS} routings a graph")
    print(f"{'tokens':>7} {'aligned':>8} {'decode':>8} {'tuned':>8} {'gain':>6}   {'routing torch':>13} "
          f"{'kernel':>7} {'gain':>6}")
    result = {"default": default, "best": dict(best), "rows": []}
    for row in rows:
        num_tokens = row["tokens"]
        if num_tokens not in token_counts:
            continue
        aligned_us = time_graph(moe_calls(num_tokens, "aligned", row["best"]), args.repeats)
        default_us, best_us = searched[tuple(default.items())][num_tokens], searched[best][num_tokens]
        _, logits, _ = routings[num_tokens]
        torch_us = time_graph([lambda x=x: select_experts_torch(x, k, "softmax_topk", True) for x in logits],
                              args.repeats)
        kernel_us = time_graph([lambda x=x: route_topk(x, k, "softmax_topk", True) for x in logits], args.repeats)
        result["rows"].append({"tokens": num_tokens, "aligned_us": aligned_us, "decode_default_us": default_us,
                               "decode_best_us": best_us, "routing_torch_us": torch_us, "routing_kernel_us": kernel_us})
        print(f"{num_tokens:>7} {aligned_us:>8.1f} {default_us:>8.1f} {best_us:>8.1f} {aligned_us / best_us:>5.2f}x   "
              f"{torch_us:>13.1f} {kernel_us:>7.1f} {torch_us / kernel_us:>5.2f}x", flush=True)
    print(f"\nDECODE_TUNED[({E}, {I}, {H}, {args.dtype!r})] = {dict(best)}  # {torch.cuda.get_device_name()}")
    return result


if __name__ == "__main__":
    main()
