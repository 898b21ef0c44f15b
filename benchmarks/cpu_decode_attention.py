"""A decode step's attention on the CPU kernel over every layer's pool, by the pool's dtype: float32 queries over a
float32 pool and over a float16 one (the GGUF blocks' default), and bfloat16 over bfloat16.

One layer's pool of a small model fits the last-level cache, where a single layer timed over and over reads it; a
decode step reads each of its layers' pools once, from memory. So each timed sweep runs one call per layer of
`--layers` pools (the embedded model: 30 layers, 9 query heads, 3 KV heads, head_dim 64), and the figure is the
sweep's median time per layer, with the bytes of keys and values read and the rate they were read at. Cases: each of
`--batch-sizes` requests at `--context-len` positions, and with `--group-size` those requests in groups on a shared
prefix of `--shared-len` positions (the shared-prefix workload's decode steps). `--page-size` places the slots that
many at a time, the pages in random order (the KV pool's scattered free list).

    python benchmarks/cpu_decode_attention.py --batch-sizes 16 --context-len 320 --page-size 16
    python benchmarks/cpu_decode_attention.py --batch-sizes 64 --context-len 560 --shared-len 512 --out FILE
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
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

# label -> (query dtype, pool dtype)
POOLS = {"float32": (torch.float32, torch.float32), "float16 pool": (torch.float32, torch.float16),
         "bfloat16": (torch.bfloat16, torch.bfloat16)}


def sweep_time(batch_size: int, context: int, shared: int, group_size: int, layers: int, page_size: int,
               queries: torch.dtype, pool: torch.dtype, repeats: int) -> dict:
    case = make_case(ForwardMode.DECODE, [context] * batch_size, [1] * batch_size, num_heads=9, num_kv_heads=3,
                     head_dim=64, page_size=page_size, dtype=queries, kv_dtype=pool, keep_reference_data=False,
                     num_layers=layers, layer_id=0)
    if shared:
        share_prefixes(case, group_size, shared)
    backend = CpuAttentionBackend()
    backend.plan(case.batch)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan), "the batch left the kernel"

    def sweep() -> float:
        start = time.perf_counter()
        for layer in range(layers):
            backend.forward(case.q, case.k, case.v, layer, case.scaling, case.batch)
        return time.perf_counter() - start

    sweep()
    seconds = statistics.median(sweep() for _ in range(repeats))
    positions = batch_size * context if not shared else (
        batch_size // group_size * shared + batch_size * (context - shared))
    kv_bytes = positions * 3 * 64 * 2 * pool.itemsize * layers
    return {"us_per_layer": 1e6 * seconds / layers, "kv_mb_per_step": kv_bytes / 1e6, "gb_per_s": kv_bytes / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--context-len", type=int, default=320)
    parser.add_argument("--shared-len", type=int, default=0, help="also the shared-prefix case (0: none)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pools", default=",".join(POOLS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if not cpu_build.load():
        raise SystemExit("the CPU kernels could not be built here")
    cases = [(int(b), 0) for b in args.batch_sizes.split(",")]
    if args.shared_len:
        cases += [(b, args.shared_len) for b, _ in cases if b >= args.group_size]
    rows = []
    for batch_size, shared in cases:
        for label in args.pools.split(","):
            queries, pool = POOLS[label]
            rows.append({"batch_size": batch_size, "context": args.context_len, "shared": shared, "pool": label,
                         **sweep_time(batch_size, args.context_len, shared, args.group_size, args.layers,
                                      args.page_size, queries, pool, args.repeats)})
    print(f"CPU ISA {cpu_build.cpu_isa()}; {torch.get_num_threads()} threads; {args.layers} layers' pools, "
          f"pages of {args.page_size}")
    print(f"{'requests':>8} {'context':>8} {'shared':>7} {'pool':<14} {'us a layer':>11} {'KV MB a step':>13} "
          f"{'GB/s':>6}")
    for r in rows:
        print(f"{r['batch_size']:>8} {r['context']:>8} {r['shared']:>7} {r['pool']:<14} {r['us_per_layer']:>11.0f} "
              f"{r['kv_mb_per_step']:>13.0f} {r['gb_per_s']:>6.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu_isa": cpu_build.cpu_isa(), "threads": torch.get_num_threads(),
                                              "args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
