"""One static batch straight through the ModelRunner (no scheduler): prefill latency, decode step latency,
each next to its floor measured in the same run.

    # Llama-3.1-8B shape, random bf16 weights, on a GPU:
    python benchmarks/one_batch.py --config benchmarks/configs/llama-3.1-8b.json --dtype bfloat16 \\
        --prefill-batch-sizes 1,8,32 --input-len 1024 \\
        --decode-batch-sizes 1,8,32,64,128,256 --context-len 1024 --eager-batch-sizes 1
    # any model (default: the embedded SmolLM2-135M), e.g. on the CPU:
    python benchmarks/one_batch.py --device cpu --prefill-batch-sizes 1 --input-len 128 \\
        --decode-batch-sizes 1,4 --context-len 128

Prefill: `batch` requests of `input-len` new tokens each, one EXTEND forward (planning included), median
latency next to the compute floor (matmul FLOPs / measured matmul rate). Decode: `batch` requests with
`context-len` positions of KV each (the pool is filled with random values first, never zeros); a step is
one DECODE forward plus the greedy pick that feeds the next step's tokens, and every step re-decodes the
last position so all steps have the same shape. It is timed from an idle device to the end of the step
(host work included), median over `--steps` after `--warmup`; "back-to-back" is the time per step when
steps are issued without waiting, i.e. what the device alone needs once the host runs ahead. The floor is
(weight bytes read + KV bytes read) / bandwidth (of a mixture of experts, only the experts a batch of that size
visits when routing spreads evenly, benchmarks/roofline.py), the bandwidth that of a device-to-device copy measured at
the start (bytes read + written / time). On a GPU, decode runs in CUDA graphs unless disabled;
`--eager-batch-sizes` repeats those sizes without graphs; `--profile-batch-size` lists the top kernels of a
few graph steps, `--profile-prefill-batch-size` those of a few prefill forwards of `--input-len` tokens each.
Times come from CUDA events on a GPU, the wall clock on the CPU.

Prints tables and writes JSON to `--out` (default $OUT, else benchmarks/results/). A stage that fails is
recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(ROOT / ".gpu-cache"))

import torch  # noqa: E402

import roofline  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.model_runner.model_runner import ModelRunner  # noqa: E402
from radixserve.model_runner.runner_config import RunnerConfig  # noqa: E402
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch  # noqa: E402
from radixserve.radix_cache.pool import FLOAT8_DTYPES, TokenToKVPool  # noqa: E402
from radixserve.runtime.wire.server_args import ServerArgs  # noqa: E402

PROFILE_STEPS = 5
PROFILE_TOP_KERNELS = 20


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="HF directory or .gguf (default: the embedded model)")
    parser.add_argument("--config", default=None, help="a config.json for random weights (implies dummy)")
    parser.add_argument("--load-format", default=None, help="auto | safetensors | gguf | dummy")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="gguf: a GGUF's linears on its own blocks (CPU)")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--decode-attention-backend", default=None)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--prefill-batch-sizes", type=int_list, default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--decode-batch-sizes", type=int_list, default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--eager-batch-sizes", type=int_list, default=[1],
                        help="decode sizes to repeat without CUDA graphs (when graphs are on)")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | fp8_e4m3 | fp8_e5m2 | ...")
    parser.add_argument("--mxfp4-experts", choices=("mxfp4", "fp8"), default=None,
                        help="how gpt-oss's MXFP4 experts are held on CUDA (models/gpt_oss.py's MXFP4_EXPERTS)")
    parser.add_argument("--disable-pdl", action="store_true",
                        help="launch the Triton kernels without programmatic dependent launch (kernels/pdl.py)")
    parser.add_argument("--profile-batch-size", type=int, default=0, help="decode batch to profile (0: none)")
    parser.add_argument("--profile-prefill-batch-size", type=int, default=0, help="prefill batch to profile (0: none)")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="one_batch", help="output file name: <tag>.json")
    return parser.parse_args(argv)


# ---- set-up ----------------------------------------------------------------------------------------

def model_source(args: argparse.Namespace, workdir: str) -> tuple[Optional[str], str]:
    """(model_path, load_format): a --config is copied into `workdir` as a dummy model directory."""
    if args.config:
        shutil.copy(args.config, os.path.join(workdir, "config.json"))
        return workdir, "dummy"
    return args.model_path, args.load_format or "auto"


def build_runner(args: argparse.Namespace, model_path: Optional[str], load_format: str,
                 disable_cuda_graph: bool) -> ModelRunner:
    """A runner whose KV pool holds exactly the largest batch this run makes (no memory profiling)."""
    all_sizes = args.prefill_batch_sizes + args.decode_batch_sizes
    page = args.page_size
    if args.mxfp4_experts is not None:
        from radixserve.model_runner.models import gpt_oss

        gpt_oss.MXFP4_EXPERTS = args.mxfp4_experts
    if args.disable_pdl:
        from radixserve.kernels import pdl

        pdl.ENABLED = False

    def pages_of(length: int) -> int:  # each request starts on a fresh page
        return -(-length // page) * page

    tokens = max([bs * pages_of(args.input_len) for bs in args.prefill_batch_sizes]
                 + [bs * pages_of(args.context_len) for bs in args.decode_batch_sizes])
    return ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_path, load_format=load_format,
        device=args.device, dtype=args.dtype, quantization=args.quantization, attention_backend=args.attention_backend,
        decode_attention_backend=args.decode_attention_backend,
        page_size=page,
        random_seed=args.seed, context_length=max(args.input_len, args.context_len), max_total_tokens=tokens,
        max_running_requests=max(all_sizes), cuda_graph_max_bs=max(args.decode_batch_sizes or [1]),
        disable_cuda_graph=disable_cuda_graph, kv_cache_dtype=args.kv_cache_dtype,
        # A static batch keeps every position of its requests: window layers' slots as many as the full layers'.
        swa_full_tokens_ratio=1.0, )))


def randomize_kv(pool: TokenToKVPool, seed: int) -> None:
    """Random KV everywhere, so attention never reads zeros."""
    generator = torch.Generator(device=pool.device).manual_seed(seed)
    for buffer in pool.k_buffer + pool.v_buffer:
        if buffer.dtype in FLOAT8_DTYPES:  # no normal_ for float8: drawn in bfloat16, then cast
            buffer.copy_(torch.empty(buffer.shape, dtype=torch.bfloat16, device=buffer.device).normal_(
                0.0, 1.0, generator=generator))
        else:
            buffer.normal_(0.0, 1.0, generator=generator)


class StaticRequests:
    """`batch_size` requests holding `length` positions of KV each; released by `free`."""

    def __init__(self, runner: ModelRunner, batch_size: int, length: int) -> None:
        self.runner = runner
        self.rows = []
        for _ in range(batch_size):
            row = runner.req_to_token_pool.alloc()
            assert row is not None, "out of request rows"
            self.rows.append(row)
        self.length = length
        self.slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, self.rows,
                                     [0] * batch_size, [length] * batch_size)

    def free(self) -> None:
        self.runner.allocator.free(self.slots)
        for row in self.rows:
            self.runner.req_to_token_pool.free(row)


def attention_backends(backend) -> str:
    """The backend's class, or for a hybrid "extend's class + decode's class"."""
    parts = [getattr(backend, "extend", None), getattr(backend, "decode", None)]
    if all(parts):
        return " + ".join(type(part).__name__ for part in parts)
    return type(backend).__name__


def environment(runner: ModelRunner) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, device=str(runner.device),
               dtype=str(runner.dtype).replace("torch.", ""), kv_dtype=str(runner.kv_cache_dtype).replace("torch.", ""),
               attention_backend=attention_backends(runner.attn_backend), page_size=runner.page_size,
               architecture=runner.model_config.architecture,
               cuda_graph_batch_sizes=runner.cuda_graph_runner.batch_sizes if runner.cuda_graph_runner else None)
    if runner.device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(runner.device), cuda=torch.version.cuda)
    for package in ("triton", "flashinfer"):
        try:
            env[package] = __import__(package).__version__
        except Exception as exc:  # noqa: BLE001 - only reported
            env[package] = f"unavailable ({type(exc).__name__})"
    return env


# ---- measurements ----------------------------------------------------------------------------------

def prefill_batch(runner: ModelRunner, requests: StaticRequests, rng: random.Random) -> ForwardBatch:
    """An EXTEND batch of random prompts filling `requests` from position 0."""
    size = len(requests.rows)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(requests.length)] for _ in range(size)]
    return make_forward_batch(ForwardMode.EXTEND, requests.rows, [0] * size, prompts, requests.slots,
                              runner.req_to_token_pool, runner.token_to_kv_pool)


def bench_prefill(runner: ModelRunner, args: argparse.Namespace, batch_size: int, matmul_rate: float,
                  bandwidth: float, weight_bytes: int, rng: random.Random) -> dict:
    requests = StaticRequests(runner, batch_size, args.input_len)
    try:
        batch = prefill_batch(runner, requests, rng)
        ms = roofline.median_ms(lambda: runner.forward(batch), runner.device, args.prefill_repeats, warmup=1)
    finally:
        requests.free()
    flops = roofline.prefill_flops(runner.model, batch_size, args.input_len)
    floor_ms = max(flops / matmul_rate, weight_bytes / bandwidth) * 1e3
    tokens = batch_size * args.input_len
    return dict(batch=batch_size, input_len=args.input_len, tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3,
                tflop=flops / 1e12, floor_ms=floor_ms, floor_fraction=floor_ms / ms)


def decode_batch(runner: ModelRunner, requests: StaticRequests, seed: int) -> ForwardBatch:
    """Every request decodes its last position (`length - 1`) again, reading `length` positions of KV."""
    last = requests.length - 1
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, runner.vocab_size, (len(requests.rows),), generator=generator).tolist()
    table = runner.req_to_token_pool.req_to_token
    rows = torch.tensor(requests.rows, dtype=torch.int64, device=table.device)
    return make_forward_batch(ForwardMode.DECODE, requests.rows, [last] * len(requests.rows),
                              [[t] for t in tokens], table[rows, last].to(torch.int64),
                              runner.req_to_token_pool, runner.token_to_kv_pool)


def decode_step_fn(runner: ModelRunner, batch: ForwardBatch, use_cuda_graph: bool) -> Callable[[], None]:
    def step() -> None:
        logits = runner.forward(batch, use_cuda_graph=use_cuda_graph)
        batch.input_ids = logits.argmax(dim=-1)  # stays on the device: no host sync between steps

    return step


def bench_decode(runner: ModelRunner, args: argparse.Namespace, batch_size: int, use_cuda_graph: bool,
                 bandwidth: float, weight_bytes: int) -> dict:
    requests = StaticRequests(runner, batch_size, args.context_len)
    try:
        batch = decode_batch(runner, requests, args.seed + batch_size)
        graphs = runner.cuda_graph_runner
        in_graph = bool(use_cuda_graph and graphs is not None and graphs.can_run(batch))
        step = decode_step_fn(runner, batch, use_cuda_graph)
        for _ in range(args.warmup):
            step()
        step_ms = statistics.median(roofline.time_ms(step, runner.device) for _ in range(args.steps))
        back_to_back_ms = roofline.time_ms(step, runner.device, calls=args.steps)
    finally:
        requests.free()
    kv_bytes = batch_size * args.context_len * TokenToKVPool.bytes_per_token(
        runner.model_config.num_hidden_layers, runner.model_config.num_key_value_heads,
        runner.model_config.head_dim, runner.kv_cache_dtype)
    floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
    return dict(batch=batch_size, context_len=args.context_len, cuda_graph=in_graph, step_ms=step_ms,
                back_to_back_ms=back_to_back_ms, floor_ms=floor_ms, floor_fraction=floor_ms / step_ms,
                tokens_per_s=batch_size / step_ms * 1e3, weight_gb=weight_bytes / 1e9, kv_gb=kv_bytes / 1e9)


def profile_steps(runner: ModelRunner, args: argparse.Namespace, batch_size: int, prefill: bool) -> dict:
    """Top device kernels of PROFILE_STEPS decode steps (CUDA graphs when available) or prefill forwards, per
    step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])

    length = args.input_len if prefill else args.context_len
    requests = StaticRequests(runner, batch_size, length)
    try:
        if prefill:
            batch = prefill_batch(runner, requests, random.Random(args.seed))

            def step() -> None:
                runner.forward(batch)
        else:
            step = decode_step_fn(runner, decode_batch(runner, requests, args.seed), True)
        for _ in range(args.warmup):
            step()
        roofline.synchronize(runner.device)
        with profile(activities=activities) as prof:
            for _ in range(PROFILE_STEPS):
                step()
            roofline.synchronize(runner.device)
    finally:
        requests.free()

    # Kernel time on a GPU; on the CPU (no device events) the operators' own CPU time.
    on_gpu = runner.device.type == "cuda"
    names = ("self_device_time_total", "self_cuda_time_total") if on_gpu else ("self_cpu_time_total",)

    def device_us(event) -> float:
        for name in names:
            if hasattr(event, name):
                return float(getattr(event, name))
        return 0.0

    def listed(event) -> bool:  # on a GPU the kernels and copies, not the host ops and API calls that issued them
        return not on_gpu or getattr(event, "device_type", None) != torch.autograd.DeviceType.CPU

    events = [e for e in prof.key_averages() if listed(e) and device_us(e) > 0]
    events.sort(key=device_us, reverse=True)
    kernels = [dict(name=e.key[:90], calls_per_step=e.count / PROFILE_STEPS,
                    us_per_step=device_us(e) / PROFILE_STEPS) for e in events[:PROFILE_TOP_KERNELS]]
    total = sum(device_us(e) for e in events) / PROFILE_STEPS
    return dict(mode="prefill" if prefill else "decode", batch=batch_size, context_len=length,
                device_us_per_step=total, top_kernels=kernels)


# ---- report ----------------------------------------------------------------------------------------

def print_report(result: dict) -> None:
    env = result["environment"]
    print(f"\n== {env.get('architecture')} on {env.get('gpu', env.get('device'))}, {env.get('dtype')}, "
          f"{env.get('attention_backend')}, page {env.get('page_size')} ==")
    print(f"copy bandwidth {result['bandwidth_tb_s']:.3g} TB/s (read + write); matmul "
          f"{result['matmul_tflop_s']:.3g} TFLOP/s; weights read per decode step {result['weight_gb']:.4g} GB")
    if result["prefill"]:
        print(f"\n{'prefill':<10}{'batch':>6}{'tokens':>8}{'ms':>10}{'tok/s':>11}{'TFLOP':>8}{'floor ms':>10}"
              f"{'floor/ms':>10}")
        for r in result["prefill"]:
            if "error" in r:
                print(f"{'':<10}{r['batch']:>6}  ERROR {r['error'][:100]}")
                continue
            print(f"{'':<10}{r['batch']:>6}{r['tokens']:>8}{r['ms']:>10.2f}{r['tokens_per_s']:>11.0f}"
                  f"{r['tflop']:>8.3g}{r['floor_ms']:>10.2f}{r['floor_fraction']:>10.1%}")
    if result["decode"]:
        print(f"\n{'decode':<10}{'batch':>6}{'context':>8}{'graph':>7}{'step ms':>10}{'b2b ms':>9}{'floor ms':>10}"
              f"{'floor/step':>11}{'tok/s':>10}{'KV GB':>8}")
        for r in result["decode"]:
            if "error" in r:
                print(f"{'':<10}{r['batch']:>6}  ERROR {r['error'][:100]}")
                continue
            print(f"{'':<10}{r['batch']:>6}{r['context_len']:>8}{'yes' if r['cuda_graph'] else 'no':>7}"
                  f"{r['step_ms']:>10.3f}{r['back_to_back_ms']:>9.3f}{r['floor_ms']:>10.3f}"
                  f"{r['floor_fraction']:>11.1%}{r['tokens_per_s']:>10.0f}{r['kv_gb']:>8.2f}")
    for profile_result in (result.get("profile"), result.get("prefill_profile")):
        if profile_result and "top_kernels" in profile_result:
            print(f"\nprofile, {profile_result['mode']} batch {profile_result['batch']} x "
                  f"{profile_result['context_len']}: {profile_result['device_us_per_step']:.0f} us of device time "
                  "per step; top kernels (us per step, calls per step):")
            for k in profile_result["top_kernels"]:
                print(f"  {k['us_per_step']:>9.1f} {k['calls_per_step']:>6.0f}  {k['name']}")
    for error in result["errors"]:
        print(f"\nERROR in {error['stage']}: {error['error']}")


def run(args: argparse.Namespace) -> dict:
    result: dict = dict(args=vars(args), prefill=[], decode=[], profile=None, prefill_profile=None, errors=[])

    def record_error(stage: str, exc: BaseException, row: Optional[dict] = None) -> None:
        message = f"{type(exc).__name__}: {exc}"
        result["errors"].append(dict(stage=stage, error=message, traceback=traceback.format_exc()))
        print(f"[one_batch] {stage} failed: {message}", file=sys.stderr, flush=True)
        if row is not None:
            row["error"] = message

    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        model_path, load_format = model_source(args, workdir)
        try:
            runner = build_runner(args, model_path, load_format, args.disable_cuda_graph)
        except Exception as exc:  # CUDA graph capture is the likeliest failure: keep the eager numbers
            if args.disable_cuda_graph:
                raise
            record_error("build runner with CUDA graphs (falling back to eager)", exc)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            runner = build_runner(args, model_path, load_format, disable_cuda_graph=True)
    device = runner.device
    result["environment"] = environment(runner)
    result["setup_seconds"] = round(time.time() - started, 1)
    bandwidth = roofline.copy_bandwidth(device)
    matmul_rate = roofline.matmul_flops(device, runner.dtype)
    weight_bytes = roofline.weight_bytes_read_per_decode_step(runner.model)
    result.update(bandwidth_tb_s=bandwidth / 1e12, matmul_tflop_s=matmul_rate / 1e12, weight_gb=weight_bytes / 1e9)
    randomize_kv(runner.token_to_kv_pool, args.seed)
    print(f"[one_batch] runner ready in {result['setup_seconds']} s; {json.dumps(result['environment'])}", flush=True)

    rng = random.Random(args.seed)
    for bs in args.prefill_batch_sizes:
        try:
            row = bench_prefill(runner, args, bs, matmul_rate, bandwidth, weight_bytes, rng)
        except Exception as exc:
            row = dict(batch=bs)
            record_error(f"prefill batch {bs}", exc, row)
        result["prefill"].append(row)
        print(f"[one_batch] prefill {row}", flush=True)

    graphs_on = runner.cuda_graph_runner is not None
    plan = [(bs, True) for bs in args.decode_batch_sizes]
    plan += [(bs, False) for bs in args.eager_batch_sizes if graphs_on]
    for bs, use_graph in plan:
        try:
            row = bench_decode(runner, args, bs, use_graph, bandwidth,
                               roofline.weight_bytes_read_per_decode_step(runner.model, bs))
        except Exception as exc:
            row = dict(batch=bs, cuda_graph=use_graph)
            record_error(f"decode batch {bs} ({'graph' if use_graph else 'eager'})", exc, row)
        result["decode"].append(row)
        print(f"[one_batch] decode {row}", flush=True)

    for key, size, prefill in (("profile", args.profile_batch_size, False),
                               ("prefill_profile", args.profile_prefill_batch_size, True)):
        if size:
            try:
                result[key] = profile_steps(runner, args, size, prefill)
            except Exception as exc:
                result[key] = {}
                record_error(key.replace("_", " "), exc, result[key])
    result["total_seconds"] = round(time.time() - started, 1)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{args.tag}.json"
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print_report(result)
    print(f"\nwrote {out_path} ({result['total_seconds']} s)")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
