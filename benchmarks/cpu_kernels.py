"""The CPU's C++ kernels against the torch path they replace, op by op, on the embedded model's shapes.

    python benchmarks/cpu_kernels.py                       # float32 and bfloat16, 2 threads (all cores)
    python benchmarks/cpu_kernels.py --threads 1 --dtypes bfloat16
    python benchmarks/cpu_kernels.py --library ~/.cache/radixserve/kernels/cpu-<key>/radixserve_cpu_kernels.so

Attention: one layer of a DECODE batch (`--batch-sizes` requests x `--context-len` positions, 9 query heads, 3 KV
heads, head_dim 64; slots scattered page by page, random KV), `torch_native` against the `cpu` backend, planning
excluded; then the same with groups of `--group-size` requests sharing their first `--shared-len` positions (the
offline shared-prefix workload's decode steps: 8 groups of 8 on a 512-token prefix at batch 64; one group at
batch 8); then one layer of a prefill of each length in `--prefill-lens` (one request, no cached prefix).
Elementwise: residual add + RMSNorm over [T, 576], SiLU-and-mul over [T, 2 x 1536], rotary over the
query and key heads of a fused projection, for T in `--tokens`, TORCH_OPS against the C++ ops. Medians of
`--repeats` calls after warm-up; prints a table with the CPU's ISA flags and writes a JSON record (`--out`).
`--library` loads a library built before (another commit's sources, from its cache folder) instead of building
this checkout's, so two builds compare in alternating runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the attention test cases build real paged batches

from attention_cases import make_case, share_prefixes  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402
from radixserve.model_runner.layers import TORCH_OPS, RotaryEmbedding, cpu_kernel_ops  # noqa: E402

def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def backend_timings(case, repeats: int) -> dict[str, float]:
    """Median microseconds of one layer's attention of `case` on torch_native and on the cpu backend, planning
    excluded."""
    timings = {}
    for name, backend in (("torch_native", TorchNativeAttention()), ("cpu", CpuAttentionBackend())):
        backend.plan(case.batch)
        timings[name] = median_us(lambda: backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling,
                                                          case.batch), repeats)
    return timings


def attention_rows(dtype: torch.dtype, batch_sizes: list[int], context: int, repeats: int, group_size: int,
                   shared_len: int) -> list[dict]:
    rows = []
    for bs, shared in [(bs, 0) for bs in batch_sizes] + [(bs, shared_len) for bs in batch_sizes if bs >= group_size]:
        case = make_case(ForwardMode.DECODE, [context] * bs, [1] * bs, num_heads=9, num_kv_heads=3, head_dim=64,
                         page_size=1, dtype=dtype, keep_reference_data=False)
        if shared:
            share_prefixes(case, group_size, shared)
        timings = backend_timings(case, repeats)
        name = f"attention decode bs={bs} ctx={context}" + (f" shared {group_size}x{shared}" if shared else "")
        rows.append(dict(op=name, torch_us=timings["torch_native"],
                         cpu_us=timings["cpu"]))
    return rows


def prefill_rows(dtype: torch.dtype, lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    for length in lengths:
        case = make_case(ForwardMode.EXTEND, [0], [length], num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                         dtype=dtype, keep_reference_data=False)
        timings = backend_timings(case, repeats)
        rows.append(dict(op=f"attention prefill T={length}", torch_us=timings["torch_native"], cpu_us=timings["cpu"]))
    return rows


def elementwise_rows(dtype: torch.dtype, tokens: list[int], repeats: int) -> list[dict]:
    ops, rotary, rows = cpu_kernel_ops(), RotaryEmbedding(64, 4096, 10000.0), []
    for t in tokens:
        x, residual = torch.randn(t, 576).to(dtype), torch.randn(t, 576).to(dtype)
        weight, gate_up = torch.ones(576).to(dtype), torch.randn(t, 3072).to(dtype)
        qkv, positions = torch.randn(t, 960).to(dtype), torch.arange(t)
        q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)
        cases = {
            "add_rms_norm": (lambda o: o.add_rms_norm(x, residual, weight, 1e-5)),
            "silu_and_mul": (lambda o: o.silu_and_mul(gate_up)),
            "rotary": (lambda o: o.rotary(positions, q, k, rotary.cos, rotary.sin)),
        }
        for name, call in cases.items():
            rows.append(dict(op=f"{name} T={t}", torch_us=median_us(lambda: call(TORCH_OPS), repeats),
                             cpu_us=median_us(lambda: call(ops), repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--batch-sizes", default="8,64")
    parser.add_argument("--context-len", type=int, default=560)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--shared-len", type=int, default=512)
    parser.add_argument("--prefill-lens", default="512,2048", help="comma-separated; empty for none")
    parser.add_argument("--tokens", default="64,512")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_kernels.json"))
    parser.add_argument("--library", default=None,
                        help="a built radixserve_cpu_kernels.so to time instead of this checkout's build")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.library:
        cpu_build.load_library(args.library)
    elif not cpu_build.load():
        raise SystemExit("the CPU kernels could not be built here")
    isa = cpu_build.cpu_isa()
    records = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        attention = attention_rows(dtype, batch_sizes, args.context_len, args.repeats, args.group_size,
                                   args.shared_len)
        prefill = prefill_rows(dtype, [int(t) for t in args.prefill_lens.split(",") if t], args.repeats)
        for row in attention + prefill + elementwise_rows(
                dtype, [int(t) for t in args.tokens.split(",")], args.repeats):
            records.append(dict(dtype=dtype_name, **row, speedup=row["torch_us"] / row["cpu_us"]))
    print(f"CPU ISA: {isa}; torch threads {torch.get_num_threads()}; torch {torch.__version__}")
    print(f"{'dtype':9} {'op':50} {'torch (us)':>11} {'C++ (us)':>10} {'speed-up':>9}")
    for r in records:
        print(f"{r['dtype']:9} {r['op']:50} {r['torch_us']:11.1f} {r['cpu_us']:10.1f} {r['speedup']:8.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(isa=isa, threads=torch.get_num_threads(), torch=torch.__version__,
                                   context_len=args.context_len, library=args.library, records=records), indent=1))
    print(f"record written to {out}")


if __name__ == "__main__":
    main()
