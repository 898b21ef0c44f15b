"""W4A16 at prefill and large-batch row counts, on the GPU: the tiled Triton kernel (weights unpacked in registers
per row block) against the dequantized path (`w4a16_dequantize` writes the weight in bfloat16, cuBLAS multiplies),
with bfloat16 `F.linear` on the same shape as the ceiling; the row count from which `w4a16_gemm` takes the
dequantized path is `DEQUANTIZE_FROM_ROWS` (kernels/w4a16_gemm.py):

    python benchmarks/w4a16_prefill.py                          # Llama-3.1-8B's projections, M = 64 .. 8192
    python benchmarks/w4a16_prefill.py --rows 256 512 --shapes 4096x4096

Operands are random (GPTQ layout, groups of 128, no act-order); each path's output is checked against the bfloat16
product of the dequantized weight before it is timed with `triton.testing.do_bench` (median). Prints a table per
shape and, per row count, the four projections' sum for each path; writes a JSON record (`--out`, or
$OUT/w4a16_prefill.json when OUT is set). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

LLAMA_8B_SHAPES = ["6144x4096", "4096x4096", "28672x4096", "4096x14336"]  # qkv, o, gate_up, down (N x K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=LLAMA_8B_SHAPES, help="N x K of each projection")
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/w4a16_prefill.py times GPU kernels: it needs CUDA")
    import triton.testing

    from radixserve.kernels.split_k import num_sms
    from radixserve.kernels.w4a16_gemm import w4a16_config, w4a16_dequantize, w4a16_gemm
    from radixserve.model_runner.quantization.int4 import Int4Weight

    device = torch.device("cuda")
    sms = num_sms(device)
    record = {"gpu": torch.cuda.get_device_name(), "group_size": args.group_size, "rows": {}}
    totals: dict[int, dict[str, float]] = {m: {"tiled": 0.0, "dequantized": 0.0, "bf16": 0.0} for m in args.rows}
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        weight = Int4Weight.quantize(torch.randn(n, k, device=device) * 0.02, args.group_size, torch.bfloat16)
        dense = w4a16_dequantize(weight.qweight, weight.scales, weight.zeros, args.group_size, None, torch.bfloat16)
        print(f"\n{shape} (N x K), group {args.group_size}: milliseconds, median")
        print(f"{'rows':>6} {'tiled':>9} {'dequantized':>12} {'(dequantize)':>13} {'bf16 mm':>9} {'tiled/deq':>10}")
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            expected = x @ dense
            config = w4a16_config(m, n, k, args.group_size, False, sms)
            paths = {
                "tiled": lambda: w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, args.group_size,
                                            None, config),
                "dequantized": lambda: x @ w4a16_dequantize(weight.qweight, weight.scales, weight.zeros,
                                                            args.group_size, None, torch.bfloat16),
                "dequantize": lambda: w4a16_dequantize(weight.qweight, weight.scales, weight.zeros,
                                                       args.group_size, None, torch.bfloat16),
                "bf16": lambda: x @ dense,
            }
            for name in ("tiled", "dequantized"):
                error = (paths[name]().float() - expected.float()).abs().max().item()
                bound = 2e-2 * expected.float().abs().max().item()
                assert error <= bound, f"{shape} M={m} {name}: max error {error:.3g} > {bound:.3g}"
            times = {name: triton.testing.do_bench(fn, return_mode="median") for name, fn in paths.items()}
            for name in ("tiled", "dequantized", "bf16"):
                totals[m][name] += times[name]
            record["rows"].setdefault(shape, {})[m] = times
            print(f"{m:>6} {times['tiled']:>9.3f} {times['dequantized']:>12.3f} {times['dequantize']:>13.3f} "
                  f"{times['bf16']:>9.3f} {times['tiled'] / times['dequantized']:>9.2f}x")
    print("\nthe projections above summed (one layer), milliseconds")
    print(f"{'rows':>6} {'tiled':>9} {'dequantized':>12} {'bf16 mm':>9}")
    for m in args.rows:
        t = totals[m]
        print(f"{m:>6} {t['tiled']:>9.3f} {t['dequantized']:>12.3f} {t['bf16']:>9.3f}")
    record["layer_totals"] = totals
    out = args.out or (os.path.join(os.environ["OUT"], "w4a16_prefill.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"record: {out}")


if __name__ == "__main__":
    main()
