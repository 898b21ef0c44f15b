"""The cost of --enable-deterministic-inference against the normal mode, side by side in one run, and (`--check`) its
bits end to end (docs/rl.md):

    python benchmarks/deterministic_cost.py [--model PATH] [--prompts 16] [--prompt-len 256] [--new-tokens 32]
    python benchmarks/deterministic_cost.py --device cuda --dtype bfloat16 --model DIR --load-format dummy --check

For each mode an Engine (the embedded SmolLM2-135M by default, float32 on the CPU) serves the same batch of random
token prompts twice (the first run warms up); the table gives the second run's wall time, the prefill and decode
throughput, and the ratio to the normal mode. `--check` first runs the acceptance check of the deterministic mode on
this device: 16 prompts (greedy and seeded top-p / top-k / min-p sampling) alone, shuffled into a batch of 64 with
random neighbours, again after cache hits, and with prefill chunks of 32 tokens, comparing their ids and the logprob
of every output token bit for bit (tests/engine/test_deterministic_inference.py runs the same on a tiny CPU model).
Writes a JSON record (--out, default benchmarks/results/deterministic_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)


def engine(args: argparse.Namespace, **mode):
    from radixserve import Engine

    extra = {"load_format": args.load_format} if args.load_format else {}
    return Engine(model_path=args.model, device=args.device, dtype=args.dtype, log_level="warning", **extra, **mode)


def run(mode: dict, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    with engine(args, **mode) as served:
        served.generate(input_ids=prompts, sampling_params=params)
        served.flush_cache()
        began = time.perf_counter()
        results = served.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - began
        served.flush_cache()
        began = time.perf_counter()
        served.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
        prefill = time.perf_counter() - began
    decode = max(wall - prefill, 1e-9)
    generated = sum(len(r["output_ids"]) for r in results)
    return {"wall_s": wall, "prefill_s": prefill,
            "prefill_tokens_per_s": sum(map(len, prompts)) / prefill,
            "decode_tokens_per_s": (generated - len(prompts)) / decode}


def _check_params(i: int) -> dict:
    """Greedy for even i; odd i sample with a seed through top-p, top-k and min-p filters in turn."""
    if i % 2 == 0:
        return {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    filters = ({"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05, "top_p": 0.95})[i // 2 % 3]
    return {"max_new_tokens": 16, "temperature": 0.9, "seed": 1000 + i, "ignore_eos": True, **filters}


def _fingerprint(result: dict) -> tuple:
    logprobs = tuple((entry[0], entry[1]) for entry in result["meta_info"]["output_token_logprobs"])
    return tuple(result["output_ids"]), logprobs


def check(args: argparse.Namespace) -> dict:
    """Of 16 prompts: how many keep their bits in a batch of 64, after cache hits, and with 32-token chunks."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 300))] for _ in range(64)]
    params = [_check_params(i) for i in range(64)]
    order = list(range(64))
    random.Random(3).shuffle(order)
    counts = {}
    with engine(args, enable_deterministic_inference=True) as served:
        alone = []
        for prompt, sampling in zip(prompts[:16], params[:16]):
            served.flush_cache()
            alone.append(_fingerprint(served.generate(input_ids=prompt, sampling_params=sampling,
                                                      return_logprob=True)))
        served.flush_cache()
        results = served.generate(input_ids=[prompts[i] for i in order], sampling_params=[params[i] for i in order],
                                  return_logprob=True)
        in_batch = {i: _fingerprint(r) for i, r in zip(order, results) if i < 16}
        counts["batch_of_64"] = sum(in_batch[i] == alone[i] for i in range(16))
        again = served.generate(input_ids=prompts[:16], sampling_params=params[:16], return_logprob=True)
        counts["cache_hits"] = sum(_fingerprint(r) == alone[i] for i, r in enumerate(again))
        counts["cached_prompts"] = sum(r["meta_info"]["cached_tokens"] > 0 for r in again)
    with engine(args, enable_deterministic_inference=True, chunked_prefill_size=32) as served:
        chunked = served.generate(input_ids=prompts[:16], sampling_params=params[:16], return_logprob=True)
        counts["chunks_of_32"] = sum(_fingerprint(r) == alone[i] for i, r in enumerate(chunked))
    with engine(args) as served:  # the normal mode, for contrast: how many keep their bits there
        results = served.generate(input_ids=[prompts[i] for i in order], sampling_params=[params[i] for i in order],
                                  return_logprob=True)
        normal = {i: _fingerprint(r) for i, r in zip(order, results) if i < 16}
        served.flush_cache()
        normal_alone = [_fingerprint(served.generate(input_ids=p, sampling_params=s, return_logprob=True))
                        for p, s in zip(prompts[:16], params[:16])]
        counts["normal_mode_batch_of_64"] = sum(normal[i] == normal_alone[i] for i in range(16))
    return counts


def main() -> None:
    from radixserve.kernels.cpu_build import cpu_isa

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default=None, help="dummy: random weights from the model's config")
    parser.add_argument("--check", action="store_true", help="check the deterministic mode's bits first")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "deterministic_cost.json"))
    args = parser.parse_args()
    record = {"cpu_isa": cpu_isa(), "load_average": os.getloadavg()[0], "args": vars(args)}
    if args.device.startswith("cuda"):
        import torch

        record["gpu"] = torch.cuda.get_device_name()
    if args.check:
        record["check"] = check(args)
        print("prompts of 16 with the bits they have alone:", record["check"])
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rows = {"normal": run({}, args, prompts),
            "deterministic": run({"enable_deterministic_inference": True}, args, prompts)}
    record["rows"] = rows
    base = rows["normal"]
    print(f"CPU ISA: {cpu_isa()}; load average {os.getloadavg()[0]:.1f}; device {record.get('gpu', args.device)}")
    print(f"{'mode':<15}{'wall s':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'wall x':>8}")
    for name, row in rows.items():
        print(f"{name:<15}{row['wall_s']:>9.2f}{row['prefill_tokens_per_s']:>15.0f}{row['decode_tokens_per_s']:>14.1f}"
              f"{row['wall_s'] / base['wall_s']:>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
