"""GPU check of the attention backends: correctness of triton and flashinfer against torch_native and a
float64 reference, then a few per-layer timings. One command on the GPU host:

    python benchmarks/gpu_check.py            # writes $OUT/gpu_check.json when OUT is set (else --out)

Correctness: random batches (EXTEND with cached prefixes, DECODE, MIXED) for page sizes 1 and 16, head
layouts with and without GQA, head_dim 128, in bfloat16 (all three backends) and float32 (torch_native and
triton; FlashInfer has no float32 kernels). Every backend must write the new K/V into the pool and match the
float64 reference within the dtype's tolerance. Timing: one attention layer (KV write + attention) of the
Llama-3.1-8B shape (32 heads, 8 KV heads, head_dim 128, bf16), median of CUDA-event timings after warm-up,
next to the floor set by reading the KV cache once at the copy bandwidth measured in the same run.

The first call on a fresh machine JIT-compiles FlashInfer (about 15 s for decode, 80 s for prefill); its
cache goes to $FLASHINFER_WORKSPACE_BASE (default: .gpu-cache/ in the checkout). A backend that fails to
build or run is reported in the table with its error; the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback
from pathlib import Path

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(ROOT / ".gpu-cache"))

import torch  # noqa: E402

from attention_cases import kv_written, make_case, reference_attention, run_backend  # noqa: E402
from radixserve.kernels.kv_indices import build_paged_kv_index  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

DEVICE = "cuda"
HEAD_DIM = 128
HEAD_LAYOUTS = [(32, 8), (8, 8), (28, 4)]  # GQA 4 (tensor-core decode), MHA (CUDA-core decode), GQA 7
PAGE_SIZES = [1, 16]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # max abs error vs the float64 reference
COPY_BYTES = 4 << 30


def random_lengths(mode: ForwardMode, rng: random.Random, page_size: int) -> tuple[list[int], list[int]]:
    """Prefix / extend lengths with empty prefixes, page-aligned and unaligned prefixes, long and 1-token
    extends, and decode contexts of 1 to 2000."""
    if mode == ForwardMode.DECODE:
        prefixes = [0, page_size, page_size - 1 if page_size > 1 else 2] + [rng.randint(1, 2000) for _ in range(13)]
        return prefixes, [1] * len(prefixes)
    if mode == ForwardMode.MIXED:
        prefixes = [rng.randint(1, 600) for _ in range(6)] + [0, 0]
        extends = [1] * 6 + [rng.randint(2, 300), rng.randint(2, 300)]
        return prefixes, extends
    prefixes = [0, 0, 4 * page_size, rng.randint(1, 900), rng.randint(1, 900), rng.randint(1, 64)]
    extends = [rng.randint(1, 400), 1, rng.randint(1, 64), rng.randint(1, 400), 1, rng.randint(100, 600)]
    return prefixes, extends


def make_backend(name: str, num_heads: int, num_kv_heads: int, page_size: int, dtype: torch.dtype):
    if name == "torch_native":
        return TorchNativeAttention()
    if name == "triton":
        return TritonAttentionBackend(num_heads, num_kv_heads, HEAD_DIM, DEVICE, max_batch_size=256)
    from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(num_heads, num_kv_heads, HEAD_DIM, dtype, DEVICE, page_size=page_size)


def check_kv_index(rows: list[dict]) -> None:
    """The device page-table kernel against a host computation from req_to_token."""
    rng = random.Random(1)
    for page_size in PAGE_SIZES:
        prefixes, extends = random_lengths(ForwardMode.EXTEND, rng, page_size)
        case = make_case(ForwardMode.EXTEND, prefixes, extends, num_heads=1, num_kv_heads=1, head_dim=16,
                         page_size=page_size, dtype=torch.bfloat16, device=DEVICE, keep_reference_data=False)
        b = case.batch
        table = b.req_to_token_pool.req_to_token.cpu()
        index = build_paged_kv_index(b.req_to_token_pool.req_to_token, b.req_pool_indices, b.seq_lens,
                                     b.seq_lens_cpu, page_size)
        expected, last = [], []
        for row, seq_len in zip(b.req_pool_indices.tolist(), b.seq_lens_cpu):
            expected += (table[row, 0:seq_len:page_size].long() // page_size).tolist()
            last.append(seq_len - (-(-seq_len // page_size) - 1) * page_size)
        ok = index.indices.tolist() == expected and index.last_page_len.tolist() == last
        ok = ok and index.indptr.tolist() == index.indptr_host.tolist()
        rows.append(dict(check="kv_index", backend="triton", page_size=page_size, ok=ok, error=None))


def check_backends(rows: list[dict], backends: list[str]) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for page_size in PAGE_SIZES:
            for num_heads, num_kv_heads in HEAD_LAYOUTS:
                built = {}
                for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED):
                    seed = 1000 * page_size + 10 * num_heads + mode.value
                    lens = random_lengths(mode, random.Random(seed), page_size)
                    reference = None
                    native_out = None
                    for name in backends:
                        if name == "flashinfer" and dtype == torch.float32:
                            continue
                        row = dict(check="attention", backend=name, dtype=str(dtype).replace("torch.", ""),
                                   page_size=page_size, heads=f"{num_heads}/{num_kv_heads}", mode=mode.name,
                                   tokens=sum(lens[1]), max_seq=max(p + e for p, e in zip(*lens)))
                        try:
                            if name not in built:
                                built[name] = make_backend(name, num_heads, num_kv_heads, page_size, dtype)
                            case = make_case(mode, *lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                             head_dim=HEAD_DIM, page_size=page_size, dtype=dtype, device=DEVICE,
                                             seed=seed)
                            if reference is None:
                                reference = reference_attention(case, device=DEVICE)
                            out = run_backend(built[name], case)
                            if DEVICE == "cuda":
                                torch.cuda.synchronize()
                            row["err_vs_ref"] = (out.double() - reference).abs().max().item()
                            if name == "torch_native":
                                native_out = out
                            elif native_out is not None:
                                row["err_vs_native"] = (out.double() - native_out.double()).abs().max().item()
                            row["kv_written"] = kv_written(case)
                            row["ok"] = row["kv_written"] and row["err_vs_ref"] <= TOLERANCE[dtype]
                            row["error"] = None
                        except Exception as exc:  # report and go on: one run must show every failure
                            row["ok"] = False
                            row["error"] = f"{type(exc).__name__}: {exc}"
                            row["traceback"] = traceback.format_exc()
                        rows.append(row)


def _median_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _host_ms(fn, iters: int = 10) -> float:
    """Median wall time of `fn` plus the device work it queued (planning is mostly host work)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.randn(COPY_BYTES // 4, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * COPY_BYTES / (ms * 1e-3)


def time_layers(rows: list[dict], backends: list[str], bandwidth: float) -> None:
    """Per-layer time of decode at 1024 context and of a 1024-token prefill, Llama-3.1-8B attention shape."""
    num_heads, num_kv_heads, context = 32, 8, 1024
    shapes = [(ForwardMode.DECODE, bs, [context - 1] * bs, [1] * bs) for bs in (1, 8, 32, 128)]
    shapes += [(ForwardMode.EXTEND, 1, [0], [context]), (ForwardMode.EXTEND, 1, [3072], [1024])]
    for name in backends:
        for page_size in PAGE_SIZES:
            try:
                backend = make_backend(name, num_heads, num_kv_heads, page_size, torch.bfloat16)
            except Exception as exc:
                rows.append(dict(backend=name, page_size=page_size, error=f"{type(exc).__name__}: {exc}"))
                continue
            for mode, bs, prefixes, extends in shapes:
                row = dict(backend=name, page_size=page_size, mode=mode.name, batch=bs,
                           prefix=prefixes[0], extend=extends[0])
                try:
                    case = make_case(mode, prefixes, extends, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=HEAD_DIM, page_size=page_size, dtype=torch.bfloat16, device=DEVICE,
                                     num_layers=1, layer_id=0, keep_reference_data=False)
                    backend.plan(case.batch)
                    row["plan_ms"] = _host_ms(lambda: backend.plan(case.batch))
                    row["layer_ms"] = _median_ms(
                        lambda: backend.forward(case.q, case.k, case.v, 0, case.scaling, case.batch))
                    kv_bytes = sum(case.batch.seq_lens_cpu) * num_kv_heads * HEAD_DIM * 2 * 2
                    row["kv_floor_ms"] = kv_bytes / bandwidth * 1e3
                    row["error"] = None
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)


def _fmt(value, spec: str) -> str:
    """`value` formatted by `spec`, or a dash of the same width when it is missing."""
    return format(value, spec) if value is not None else format("-", f">{spec.split('.')[0]}")


def print_tables(checks: list[dict], timings: list[dict]) -> None:
    print("\n== correctness (max abs error; bf16 tol %.0e, fp32 tol %.0e) ==" % (
        TOLERANCE[torch.bfloat16], TOLERANCE[torch.float32]))
    print(f"{'backend':<13}{'dtype':<10}{'page':>5} {'heads':<7}{'mode':<8}{'tokens':>7}{'max_seq':>8}"
          f"{'err_ref':>11}{'err_native':>12}  kv  result")
    for r in checks:
        if r["check"] == "kv_index":
            print(f"{'kv_index':<13}{'int32':<10}{r['page_size']:>5} {'':<7}{'':<8}{'':>7}{'':>8}{'':>11}{'':>12}"
                  f"  --  {'PASS' if r['ok'] else 'FAIL'}")
            continue
        result = "PASS" if r["ok"] else ("FAIL " + (r["error"] or ""))[:120]
        print(f"{r['backend']:<13}{r['dtype']:<10}{r['page_size']:>5} {r['heads']:<7}{r['mode']:<8}{r['tokens']:>7}"
              f"{r['max_seq']:>8}{_fmt(r.get('err_vs_ref'), '11.2e')}{_fmt(r.get('err_vs_native'), '12.2e')}"
              f"  {'ok' if r.get('kv_written') else '--'}  {result}")
    print("\n== one attention layer, Llama-3.1-8B shape (32/8 heads, d=128, bf16), median ms ==")
    print(f"{'backend':<13}{'page':>5} {'mode':<8}{'batch':>6}{'prefix':>7}{'extend':>7}{'plan':>9}{'layer':>9}"
          f"{'kv floor':>10}{'floor/layer':>12}")
    for r in timings:
        if r.get("error"):
            print(f"{r['backend']:<13}{r['page_size']:>5} {r.get('mode', ''):<8} ERROR {r['error'][:100]}")
            continue
        print(f"{r['backend']:<13}{r['page_size']:>5} {r['mode']:<8}{r['batch']:>6}{r['prefix']:>7}{r['extend']:>7}"
              f"{r['plan_ms']:>9.3f}{r['layer_ms']:>9.3f}{r['kv_floor_ms']:>10.4f}"
              f"{r['kv_floor_ms'] / r['layer_ms']:>12.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default $OUT)")
    parser.add_argument("--backends", default="torch_native,triton,flashinfer")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
    backends = args.backends.split(",")
    env = dict(python=platform.python_version(), torch=torch.__version__, gpu=torch.cuda.get_device_name(),
               cuda=torch.version.cuda)
    import triton

    env["triton"] = triton.__version__
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError as exc:
        env["flashinfer"] = f"not importable: {exc}"
    print(json.dumps(env))

    started = time.time()
    checks: list[dict] = []
    check_kv_index(checks)
    check_backends(checks, backends)
    env["check_seconds"] = round(time.time() - started, 1)
    timings: list[dict] = []
    if not args.skip_timing:
        env["copy_bandwidth_tb_s"] = copy_bandwidth() / 1e12
        time_layers(timings, backends, env["copy_bandwidth_tb_s"] * 1e12)
    env["total_seconds"] = round(time.time() - started, 1)

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "gpu_check.json", "w") as f:
            json.dump(dict(environment=env, checks=checks, timings=timings), f, indent=1)
    print_tables(checks, timings)
    failed = [r for r in checks if not r["ok"]]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed in {env['check_seconds']} s; "
          f"copy bandwidth {env.get('copy_bandwidth_tb_s', 0):.2f} TB/s; total {env['total_seconds']} s")
    for r in failed[:3]:
        if r.get("traceback"):
            print(r["traceback"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
