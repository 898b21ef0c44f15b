"""The cost of --enable-deterministic-inference against the normal mode, side by side in one run (docs/rl.md):

    python benchmarks/deterministic_cost.py [--model PATH] [--prompts 16] [--prompt-len 256] [--new-tokens 32]

For each mode an Engine (the embedded SmolLM2-135M by default, float32 on the CPU) serves the same batch of random
token prompts twice (the first run warms up); the table gives the second run's wall time, the prefill and decode
throughput, and the ratio to the normal mode. Writes a JSON record (--out, default
benchmarks/results/deterministic_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)


def run(mode: dict, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from radixserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    with Engine(model_path=args.model, device="cpu", dtype="float32", log_level="warning", **mode) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)
        engine.flush_cache()
        began = time.perf_counter()
        results = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - began
        engine.flush_cache()
        began = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
        prefill = time.perf_counter() - began
    decode = max(wall - prefill, 1e-9)
    generated = sum(len(r["output_ids"]) for r in results)
    return {"wall_s": wall, "prefill_s": prefill,
            "prefill_tokens_per_s": sum(map(len, prompts)) / prefill,
            "decode_tokens_per_s": (generated - len(prompts)) / decode}


def main() -> None:
    from radixserve.kernels.cpu_build import cpu_isa

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "deterministic_cost.json"))
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rows = {"normal": run({}, args, prompts),
            "deterministic": run({"enable_deterministic_inference": True}, args, prompts)}
    base = rows["normal"]
    print(f"CPU ISA: {cpu_isa()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<15}{'wall s':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'wall x':>8}")
    for name, row in rows.items():
        print(f"{name:<15}{row['wall_s']:>9.2f}{row['prefill_tokens_per_s']:>15.0f}{row['decode_tokens_per_s']:>14.1f}"
              f"{row['wall_s'] / base['wall_s']:>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu_isa": cpu_isa(), "load_average": os.getloadavg()[0], "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
