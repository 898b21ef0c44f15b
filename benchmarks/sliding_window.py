"""What a sliding window saves in attention on the CPU: one layer of a DECODE batch and of a prefill, full attention
against a window, side by side on the same batch.

    python benchmarks/sliding_window.py                      # float32, window 512, contexts 1024,4096
    python benchmarks/sliding_window.py --dtype bfloat16 --window 1024 --context-lens 8192

Decode: `--batch-size` requests x `--context-len` positions (Gemma 3 1B's heads: 4 query heads, 1 KV head, head_dim
256; slots scattered page by page, random KV), one layer on `torch_native` and on the `cpu` backend, planning
excluded (a windowed layer plans once per batch, at its first layer). Prefill: one request of `--prefill-len` new
tokens, no cached prefix. Medians of `--repeats` calls after warm-up, full and windowed calls alternating; prints a table with the CPU's ISA flags and
writes a JSON record (`--out`). The window reads W keys a query instead of the whole context, so decode time should
fall with W / context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

sys.path.insert(0, str(ROOT / "tests"))  # the attention test cases build real paged batches

import torch  # noqa: E402

from attention_cases import make_case  # noqa: E402
from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256


def layer_times(case, window: int, repeats: int) -> list[dict]:
    """Median ms of one layer, full and windowed, on each backend; the two are timed alternately, call by call, so
    the load of a shared machine weighs on both alike."""
    rows = []
    for name, backend in (("torch_native", TorchNativeAttention()), ("cpu", CpuAttentionBackend(max_extend_len=None))):
        backend.plan(case.batch)
        calls = {label: (lambda w=w: backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch,
                                                     w)) for label, w in (("full", None), ("window", window))}
        times: dict[str, list[float]] = {"full": [], "window": []}
        for call in calls.values():
            call()
        for _ in range(repeats):
            for label, call in calls.items():
                start = time.perf_counter()
                call()
                times[label].append((time.perf_counter() - start) * 1e3)
        full, windowed = statistics.median(times["full"]), statistics.median(times["window"])
        rows.append(dict(backend=name, full_ms=full, window_ms=windowed, speedup=full / windowed))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--context-lens", default="1024,4096")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sliding_window.json"))
    args = parser.parse_args()
    assert cpu_build.load(), "the CPU kernels failed to build"
    dtype = getattr(torch, args.dtype)
    shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=1, dtype=dtype,
                 keep_reference_data=False)
    results = []
    for context in [int(c) for c in args.context_lens.split(",")]:
        case = make_case(ForwardMode.DECODE, [context - 1] * args.batch_size, [1] * args.batch_size, **shape)
        for row in layer_times(case, args.window, args.repeats):
            results.append(dict(kind="decode", context=context, batch=args.batch_size, **row))
    case = make_case(ForwardMode.EXTEND, [0], [args.prefill_len], **shape)
    for row in layer_times(case, args.window, max(3, args.repeats // 3)):
        results.append(dict(kind="prefill", context=args.prefill_len, batch=1, **row))
    record = dict(cpu_isa=cpu_build.cpu_isa(), threads=torch.get_num_threads(), dtype=args.dtype, window=args.window,
                  heads=f"{HEADS}/{KV_HEADS}x{HEAD_DIM}", rows=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"CPU {record['cpu_isa']}, {record['threads']} threads, {args.dtype}, window {args.window}")
    print(f"{'kind':8} {'context':>8} {'batch':>5} {'backend':12} {'full ms':>9} {'window ms':>10} {'ratio':>6}")
    for r in results:
        print(f"{r['kind']:8} {r['context']:>8} {r['batch']:>5} {r['backend']:12} {r['full_ms']:>9.2f} "
              f"{r['window_ms']:>10.2f} {r['speedup']:>6.2f}")


if __name__ == "__main__":
    main()
