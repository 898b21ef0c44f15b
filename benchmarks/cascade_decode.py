"""Decode attention with and without cascade on FlashInfer (GPU): a batch whose requests share long cached prefixes.

SGLang's generated-shared-prefix shape by default: 64 groups x 16 requests, 2048 shared positions, then 128 + i
positions of their own, Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16), page size 1.
Times one decode step's attention over `--layers` layers (plan once, then one call per layer, CUDA events, median
of `--repeats` after warm-up), plain decode against cascade (the shared keys read once per group), checks that
both give the same output, and reports the KV bytes each reads against the measured copy bandwidth.

    python benchmarks/cascade_decode.py --out docs/results/cascade_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from attention_cases import make_case  # noqa: E402
from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode, PrefixGroups  # noqa: E402


def build(groups: int, per_group: int, shared: int, own: int, heads: int, kv_heads: int, head_dim: int):
    lens = [shared + own + i % 256 for i in range(groups * per_group)]
    case = make_case(ForwardMode.DECODE, lens, [1] * len(lens), num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, page_size=1, dtype=torch.bfloat16, device="cuda", seed=0, num_layers=1,
                     layer_id=0, keep_reference_data=False)
    table = case.batch.req_to_token_pool.req_to_token
    rows = case.batch.req_pool_indices.tolist()
    members = [list(range(g * per_group, (g + 1) * per_group)) for g in range(groups)]
    for group in members:
        for i in group[1:]:
            table[rows[i], :shared] = table[rows[group[0]], :shared]
    return case, PrefixGroups(members=members, lengths=[shared] * groups)


def time_step(backend, case, layers: int, repeats: int) -> tuple[list[float], torch.Tensor]:
    times, out = [], None
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backend.plan(case.batch)
        for _ in range(layers):
            out = backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times[2:], out


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GB device-to-device copy."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--shared", type=int, default=2048)
    p.add_argument("--own", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    heads, kv_heads, head_dim = 32, 8, 128
    case, groups = build(args.groups, args.per_group, args.shared, args.own, heads, kv_heads, head_dim)
    bandwidth = copy_bandwidth()
    bytes_per_position = 2 * kv_heads * head_dim * 2 * args.layers
    total_positions = sum(case.batch.seq_lens_cpu)
    rows = []
    outputs = {}
    for name in ("plain", "cascade"):
        backend = FlashInferAttentionBackend(heads, kv_heads, head_dim, torch.bfloat16, "cuda", page_size=1)
        backend.cascade_min_saved_bytes = 0
        case.batch.prefix_groups = groups if name == "cascade" else None
        began = time.perf_counter()
        backend.plan(case.batch)
        backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch)
        torch.cuda.synchronize()
        first = time.perf_counter() - began
        times, outputs[name] = time_step(backend, case, args.layers, args.repeats)
        read = total_positions - (groups.saved_positions() if name == "cascade" else 0)
        median = statistics.median(times)
        rows.append({"mode": name, "first_call_s": round(first, 2), "step_ms": round(median, 3),
                     "kv_gb_read": round(read * bytes_per_position / 1e9, 2),
                     "floor_ms": round(read * bytes_per_position / bandwidth * 1e3, 3),
                     "cascade_batches": backend.num_cascade_batches})
    error = (outputs["plain"].float() - outputs["cascade"].float()).abs().max().item()
    print(f"batch {len(case.batch.seq_lens_cpu)}: {args.groups} groups x {args.per_group}, {args.shared} shared + "
          f"{args.own}-{args.own + 255} own positions; {args.layers} layers; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'mode':8} {'step ms':>9} {'KV GB':>7} {'floor ms':>9} {'of floor':>8} {'first call s':>12}")
    for row in rows:
        print(f"{row['mode']:8} {row['step_ms']:9.3f} {row['kv_gb_read']:7.2f} {row['floor_ms']:9.3f} "
              f"{row['floor_ms'] / row['step_ms']:8.1%} {row['first_call_s']:12.2f}")
    print(f"speed-up {rows[0]['step_ms'] / rows[1]['step_ms']:.2f}x; max abs difference of outputs {error:.2e}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "bandwidth_bytes_per_s": bandwidth, "rows": rows,
                       "max_abs_difference": error, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
