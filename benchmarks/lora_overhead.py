"""Batched LoRA's cost: one batch of greedy generations through the Engine, with requests on the base model only,
all on one adapter, and spread over several adapters plus the base model, against an Engine without LoRA.

Adapters are random-weight PEFT folders written to a temporary directory (rank `--rank`, every projection).
Prints a table and the CPU's ISA; `--out` writes the JSON record.

    python benchmarks/lora_overhead.py --out docs/results/lora_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

import torch
from safetensors.torch import save_file

import _srcpath  # noqa: F401  (radixserve.<folder> from the checkout)
from radixserve import Engine
from radixserve.kernels.cpu_build import cpu_isa

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: str, config: dict, rank: int, seed: int) -> str:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, block in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, shapes[module][0], generator=generator) * 0.05
            tensors[prefix + ".lora_B.weight"] = torch.randn(shapes[module][1], rank, generator=generator) * 0.05
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none"}, f)
    return folder


def timed(engine: Engine, prompts: list[str], loras: Optional[list[Optional[str]]], output_len: int,
          repeats: int) -> float:
    """Best wall time of `repeats` runs of the whole batch."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, params, lora_path=loras)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prompts = [f"Request {i}: describe the weather in a coastal town in autumn." for i in range(args.batch_size)]
    names = [f"adapter{i}" for i in range(args.num_adapters)]
    record: dict[str, Any] = {"cpu_isa": cpu_isa(), "cores": os.cpu_count(), "args": vars(args), "modes": {}}
    print(f"CPU: {record['cpu_isa']}, {record['cores']} cores; torch {torch.__version__}")

    with Engine(log_level="warning", disable_radix_cache=True) as engine:
        model_dir = engine.model_info.model_path
        record["modes"]["no LoRA engine"] = timed(engine, prompts, None, args.output_len, args.repeats)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    folder = tempfile.mkdtemp(prefix="radixserve-lora-bench-")
    paths = [f"{name}={write_adapter(os.path.join(folder, name), config, args.rank, i)}"
             for i, name in enumerate(names)]
    with Engine(log_level="warning", disable_radix_cache=True, lora_paths=paths,
                max_loras_per_batch=args.num_adapters) as engine:
        modes = record["modes"]
        modes["LoRA engine, base requests"] = timed(engine, prompts, None, args.output_len, args.repeats)
        modes["one adapter"] = timed(engine, prompts, [names[0]] * len(prompts), args.output_len, args.repeats)
        mixed = [None if i % (len(names) + 1) == len(names) else names[i % (len(names) + 1)]
                 for i in range(len(prompts))]
        modes[f"{len(names)} adapters + base, mixed"] = timed(engine, prompts, mixed, args.output_len, args.repeats)

    base = record["modes"]["no LoRA engine"]
    tokens = args.batch_size * args.output_len
    print(f"\nbatch {args.batch_size} x {args.output_len} tokens, rank {args.rank}\n")
    print("| requests | wall (s) | output tok/s | vs no LoRA |")
    print("| --- | --- | --- | --- |")
    for mode, seconds in record["modes"].items():
        print(f"| {mode} | {seconds:.2f} | {tokens / seconds:.1f} | {seconds / base:.2f}x |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")
    sys.exit(0)


if __name__ == "__main__":
    main()
