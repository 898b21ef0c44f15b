"""Tune the fused MoE kernels' block sizes (kernels/fused_moe_configs.py) for one layer shape on the GPU at hand:

    python benchmarks/tune_fused_moe.py                       # Qwen3-30B-A3B: 128 experts, top-8, I=768, H=2048, bf16
    python benchmarks/tune_fused_moe.py --experts 64 --top-k 8 --intermediate 1408 --hidden 2048 --tokens 1,8,64

For each token count, every config of the search space runs `fused_moe` on random routed inputs (softmax top-k over
random router logits), timed with CUDA events after warm-up (median of `--repeats`), and the fastest is kept when it
also matches the default config's output (max abs difference within bf16 rounding). Prints, per token count, the
default config's time, the best time and the best config; then the rows to paste into `TUNED` (consecutive token
counts with the same best config merged), each token count's row covering up to the next one. Writes a JSON record
(--out, or $OUT/tune_fused_moe.json when OUT is set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)

SPACE = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (64, 128), "num_warps": (4, 8),
         "num_stages": (3, 4)}


def configs() -> list[dict[str, int]]:
    keys = list(SPACE)
    return [dict(zip(keys, values)) for values in itertools.product(*(SPACE[k] for k in keys))]


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
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "tune_fused_moe.json"))
    args = parser.parse_args()

    import torch

    from radixserve.kernels.fused_moe_configs import block_config
    from radixserve.kernels.fused_moe_triton import fused_moe
    from radixserve.model_runner.moe.routing import select_experts

    dtype = getattr(torch, args.dtype)
    E, I, H, k = args.experts, args.intermediate, args.hidden, args.top_k
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=generator) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=generator) * I ** -0.5).to(dtype)
    print(f"GPU {torch.cuda.get_device_name()}; shape experts {E}, top-{k}, intermediate {I}, hidden {H}, {args.dtype}")
    print(f"{'tokens':>7} {'default us':>11} {'best us':>9} {'gain':>6}  best config")
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        hidden = (torch.randn(num_tokens, H, device="cuda", generator=generator)).to(dtype)
        logits = torch.randn(num_tokens, E, device="cuda", generator=generator)
        weights, ids = select_experts(logits, k, "softmax_topk", renormalize=True)
        default = block_config(num_tokens, E, I, H, args.dtype)
        reference = fused_moe(hidden, w13, w2, weights, ids, dict(default))
        tolerance = 2e-2 * float(reference.abs().max()) + 1e-3
        default_us = time_config(lambda: fused_moe(hidden, w13, w2, weights, ids, dict(default)), args.repeats)
        best_us, best = default_us, default
        for config in configs():
            try:
                out = fused_moe(hidden, w13, w2, weights, ids, dict(config))
            except Exception:  # a config past the GPU's shared memory: skipped
                continue
            if float((out.float() - reference.float()).abs().max()) > tolerance:
                continue
            us = time_config(lambda: fused_moe(hidden, w13, w2, weights, ids, dict(config)), args.repeats)
            if us < best_us:
                best_us, best = us, config
        rows.append({"tokens": num_tokens, "default_us": default_us, "best_us": best_us, "best": best,
                     "default": default})
        print(f"{num_tokens:>7} {default_us:>11.1f} {best_us:>9.1f} {default_us / best_us:>5.2f}x  {best}", flush=True)

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
                   "hidden": H, "dtype": args.dtype}, "rows": rows, "table": merged}, f, indent=2)


if __name__ == "__main__":
    main()
