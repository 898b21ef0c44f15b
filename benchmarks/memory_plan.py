"""The GPU memory plan a server would start with: weights, KV pool and the measured reserve.

    python benchmarks/memory_plan.py --model .gpu-assets/llama-3.1-8b-dummy --load-format dummy --dtype bfloat16 \\
        --out results/memory_plan.json [--engine-arg mem_fraction_static=0.8 ...]

Builds the ModelRunner exactly as the scheduler does (profiling forward, attention backend, CUDA graphs), prints
the plan as a table and what the device holds once the graphs are captured, and writes them as one JSON record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _srcpath  # noqa: E402,F401
import torch  # noqa: E402

from radixserve.model_runner.memory_plan import GiB  # noqa: E402
from radixserve.model_runner.model_runner import ModelRunner  # noqa: E402
from radixserve.model_runner.runner_config import RunnerConfig  # noqa: E402
from radixserve.runtime.wire.server_args import ServerArgs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--engine-arg", action="append", default=[], help="ServerArgs field=value (repeatable)")
    parser.add_argument("--out", help="JSON record path")
    args = parser.parse_args()
    extra = {}
    for item in args.engine_arg:
        key, value = item.split("=", 1)
        extra[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=args.model, load_format=args.load_format,
        dtype=args.dtype, **extra)))
    torch.cuda.synchronize()
    plan = runner.memory_plan
    free, total = torch.cuda.mem_get_info()
    record = {**dataclasses.asdict(plan), "reserve": plan.reserve, "max_running_requests": runner.max_running_requests,
              "free_after_start": free, "engine_args": extra}
    rows = [("weights", plan.weights), ("KV pool", plan.kv), ("step activations", plan.activations),
            ("attention workspaces", plan.workspace), ("CUDA graphs (planned)", plan.cuda_graphs),
            ("request table", plan.request_table), ("margin", plan.margin), ("reserve", plan.reserve),
            ("free once started", free)]
    print(f"{plan.device_name}, {total / GiB:.1f} GiB, plan: {plan.source}; KV {plan.kv_tokens} tokens, "
          f"{runner.max_running_requests} running requests")
    print(f"| {'part':<24} | {'GiB':>8} |")
    for name, value in rows:
        print(f"| {name:<24} | {value / GiB:8.2f} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
