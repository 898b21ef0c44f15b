"""Tune the skinny decode GEMMs (kernels/w4a16_gemm.py, kernels/fp8_skinny_gemm.py) at decode row counts, on the GPU:

    python benchmarks/tune_w4a16.py                  # Llama-3.1-8B's projections, M = 1, 4, 16, W4A16 and FP8
    python benchmarks/tune_w4a16.py --formats w4a16 --rows 1 --shapes 4096x4096
    python benchmarks/tune_w4a16.py --formats w16 --rows 1,8 --shapes 5120x2048,2048x4096,128x2048  # 16-bit weights

For each (format, shape N x K, rows M), every candidate tile (`SkinnyConfig`: columns, K step, K
split, FMAs or tensor cores, warps, stages) runs on random operands and is checked against the product of the
activations and the dequantized weight in bfloat16 (torch's matmul); the ones within bfloat16 rounding are timed with
`triton.testing.do_bench` (median; the L2 cache is flushed before each call, as a decode step's weights are cold), and
the fastest is kept. Beside it the script times the kernel's default config, the tiled W4A16 kernel that served
these rows before (16-row tensor-core tiles) and, as the memory-bound reference, bfloat16 `F.linear` on the same shape
and a device-to-device copy. Formats: `w4a16` (GPTQ layout, groups of 128, no act-order; `--act-order` adds g_idx),
`w16` (16-bit weights on the FP8 kernels with no scale, against cuBLAS),
`fp8_channel` (one scale per output channel), `fp8_tensor` (one scale for the matrix, spread over the rows as
model_runner/quantization/fp8.py stores it: the same kernel as per channel, so only the default and the per-channel
best are checked and timed), `fp8_block` (128 x 128 blocks).

Prints, per format, shape and M: the default's and the best's time, the best's share of the copy bandwidth, and the
best config; then the estimated batch-1 decode GEMM time of a step (4 projections x `--layers` at M = 1) against the
weight bytes' floor; then the rows to paste into `TUNED_SKINNY` (kernels/w4a16_gemm.py) and `TUNED` /
`TUNED_16BIT` (kernels/fp8_skinny_gemm.py). Writes a JSON record (--out, or $OUT/tune_w4a16.json when OUT is set).

Without CUDA the script runs under the Triton interpreter, timed with the wall clock (a check of the script, not a
measurement): use tiny shapes, e.g. `--shapes 64x256 --rows 1 --space small`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from _srcpath import ROOT  # noqa: E402,F401  (maps radixserve.<folder> onto the checkout)

LLAMA_8B_SHAPES = "6144x4096,4096x4096,28672x4096,4096x14336"  # N x K: qkv, o, gate/up, down
GROUP_SIZE = 128


def parse_dims(text: str) -> list[tuple[int, ...]]:
    """Comma-separated items of sizes joined by x, as integer tuples: 6144x4096,4096x4096 -> [(6144, 4096), ...]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


# The candidates' axes, per kernel (FMA: one row a program; dot: 16 rows on the tensor cores), kept to what one run of
# a few minutes compiles and times: the FMA loop's loads are not software-pipelined, so its stages stay fixed; a 16-row
# tensor-core tile keeps four warps busy. "small" is for checking the script without a GPU.
SPACES = {
    "full": {"fma": {"block_n": (32, 64, 128, 256), "block_k": (64, 128, 256, 512), "num_warps": (4, 8),
                     "num_stages": (3,)},
             "dot": {"block_n": (32, 64, 128), "block_k": (64, 128, 256), "num_warps": (4,),
                     "num_stages": (3, 4)},
             "split_k": (1, 2, 4, 8, 16)},
    "small": {"fma": {"block_n": (32,), "block_k": (64,), "num_warps": (4,), "num_stages": (2,)},
              "dot": {"block_n": (32,), "block_k": (64,), "num_warps": (4,), "num_stages": (2,)},
              "split_k": (1, 2)},
}


def candidates(space: dict, m: int, k: int, max_block_k: dict) -> list:
    """The configs worth timing at m rows: FMAs only up to 4 rows (an FMA program dequantizes for one row), a K step
    up to `max_block_k[kernel]` (the group or scale block where a tile must lie in one), at least two K tiles per
    split."""
    from radixserve.kernels.split_k import SkinnyConfig

    found = []
    for kernel in (("fma", "dot") if m <= 4 else ("dot",)):
        axes = space[kernel]
        for block_n, block_k, warps, stages, split_k in itertools.product(*axes.values(), space["split_k"]):
            if block_k <= max_block_k[kernel] and -(-k // block_k) >= 2 * split_k:
                found.append(SkinnyConfig(block_n, block_k, split_k, kernel == "dot", warps, stages))
    return found


def timer(on_gpu: bool, repeats: int):
    """Median microseconds of a call: do_bench on the GPU (L2 flushed before each call), the wall clock elsewhere."""
    if on_gpu:
        import triton.testing

        return lambda fn: 1000.0 * triton.testing.do_bench(fn, warmup=2, rep=repeats, return_mode="median")

    def wall(fn):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    return wall


def copy_bandwidth(device: str, time_us) -> float:
    """Bytes read and written per second by a device-to-device copy of 1 GiB (on the GPU), the memory ceiling."""
    if device != "cuda":
        return float("nan")
    source = torch.empty(1 << 29, dtype=torch.float16, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() * 2 / (time_us(lambda: target.copy_(source)) * 1e-6)


def w4a16_case(m: int, n: int, k: int, act_order: bool, device: str, dtype: torch.dtype, num_sms: int):
    """The callable product for a config, its reference, its default config, the weight's bytes, and the tiled
    kernel's call (the kernel these rows took before the skinny ones)."""
    from radixserve.kernels.w4a16_gemm import W4A16Config, skinny_config, w4a16_gemm
    from radixserve.model_runner.quantization.int4 import Int4Weight

    generator = torch.Generator(device=device).manual_seed(n * 7 + k)
    weight = Int4Weight.quantize(torch.randn(n, k, device=device, generator=generator) * k ** -0.5, GROUP_SIZE, dtype)
    if act_order:
        order = torch.randperm(k, device=device, generator=generator)
        weight = Int4Weight(weight.qweight, weight.scales, weight.zeros, GROUP_SIZE,
                            (order // GROUP_SIZE).to(torch.int32))
    x = torch.randn(m, k, device=device, generator=generator).to(dtype)
    reference = x @ weight.dequantize(dtype).T

    def run(config):
        return w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, GROUP_SIZE, weight.g_idx, config)

    weight_bytes = weight.qweight.numel() * 4 + weight.scales.numel() * weight.scales.element_size() * 2
    default = skinny_config(m, n, k, GROUP_SIZE, act_order, num_sms)
    tiles = -(-n // 64)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= -(-k // 128) // 4 and split < 16:
        split *= 2
    tiled = W4A16Config(16, 64, 128, split, 4, 4)
    return run, reference, default, weight_bytes, lambda: run(tiled), x


def fp8_case(m: int, n: int, k: int, scales: str, device: str, dtype: torch.dtype, num_sms: int):
    from radixserve.kernels.fp8_skinny_gemm import fp8_skinny_config, w8a16_gemm
    from radixserve.model_runner.quantization.fp8 import Fp8Weight

    generator = torch.Generator(device=device).manual_seed(n * 7 + k)
    dense = torch.randn(n, k, device=device, generator=generator) * k ** -0.5
    block = (128, 128) if scales == "block" else None
    weight = Fp8Weight.quantize(dense, block, per_tensor=scales == "tensor")
    x = torch.randn(m, k, device=device, generator=generator).to(dtype)
    reference = x @ weight.dequantize().to(dtype).T

    def run(config):
        return w8a16_gemm(x, weight.weight, weight.scale, block, config)

    weight_bytes = weight.weight.numel() + weight.scale.numel() * 4
    return run, reference, fp8_skinny_config(m, n, k, block, num_sms), weight_bytes, None, x


def w16_case(m: int, n: int, k: int, device: str, dtype: torch.dtype, num_sms: int):
    """A 16-bit weight on the same kernels (no scale): the decode products cuBLAS streams slowly."""
    from radixserve.kernels.fp8_skinny_gemm import skinny_16bit_config, w16a16_gemm

    generator = torch.Generator(device=device).manual_seed(n * 7 + k)
    weight = (torch.randn(n, k, device=device, generator=generator) * k ** -0.5).to(dtype)
    x = torch.randn(m, k, device=device, generator=generator).to(dtype)
    reference = x @ weight.T

    def run(config):
        return w16a16_gemm(x, weight, config)

    return run, reference, skinny_16bit_config(m, n, k, num_sms), weight.numel() * weight.element_size(), None, x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="w4a16,fp8_channel,fp8_tensor,fp8_block")
    parser.add_argument("--shapes", default=LLAMA_8B_SHAPES, help="N x K, comma separated")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--act-order", action="store_true", help="W4A16 with a g_idx (a random act-order)")
    parser.add_argument("--space", choices=sorted(SPACES), default="full")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers, for the per-step estimate")
    parser.add_argument("--repeats", type=int, default=10, help="do_bench's rep, milliseconds")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "tune_w4a16.json"))
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter has no bfloat16 dot
    from radixserve.kernels.split_k import num_sms as sm_count

    num_sms = sm_count(torch.device(device))
    gpu = torch.cuda.get_device_name() if on_gpu else "none (Triton interpreter, wall clock)"
    time_us = timer(on_gpu, args.repeats)
    bandwidth = copy_bandwidth(device, time_us)
    shapes = parse_dims(args.shapes)
    row_counts = [int(r) for r in args.rows.split(",")]
    print(f"GPU {gpu}, {num_sms} SMs; copy bandwidth {bandwidth / 1e12:.2f} TB/s; space {args.space}", flush=True)
    print(f"{'format':<12} {'N x K':>12} {'M':>3} {'default us':>10} {'best us':>8} {'tiled us':>8} "
          f"{'bf16 us':>8} {'best/copy':>9} {'tried':>5}  best config")
    rows, tables = [], {}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write_record() -> None:  # after every case, so that a run stopped by a time limit keeps what it measured
        with open(args.out, "w") as f:
            json.dump({"benchmark": "tune_w4a16", "gpu": gpu, "num_sms": num_sms, "copy_bandwidth": bandwidth,
                       "args": vars(args), "rows": rows}, f, indent=2)

    for fmt in args.formats.split(","):
        for n, k in shapes:
            dense_weight = torch.randn(n, k, device=device, dtype=dtype)
            for m in row_counts:
                if fmt == "w4a16":  # the W4A16 FMA kernel reads scales per word row: its K tiles may span groups
                    case = w4a16_case(m, n, k, args.act_order, device, dtype, num_sms)
                    max_block_k = {"fma": 512, "dot": 256 if args.act_order else GROUP_SIZE}
                elif fmt == "w16":
                    case = w16_case(m, n, k, device, dtype, num_sms)
                    max_block_k = {"fma": 256, "dot": 256}
                else:
                    case = fp8_case(m, n, k, fmt.split("_")[1], device, dtype, num_sms)
                    max_block_k = dict.fromkeys(("fma", "dot"), 128 if fmt == "fp8_block" else 256)
                run, reference, default, weight_bytes, tiled, x = case
                tolerance = 2e-2 * float(reference.abs().max()) + 1e-3
                tried, failed, best_us, best, default_us = 0, [], float("inf"), None, float("nan")
                if fmt == "fp8_tensor" and ("fp8_channel", n, k) in tables:
                    # The per-channel kernel with other scale values: its best config is checked and timed here.
                    space = [dict(tables[("fp8_channel", n, k)])[m]]
                else:
                    space = candidates(SPACES[args.space], m, k, max_block_k)
                for config in [default] + [c for c in space if c != default]:
                    try:
                        error = float((run(config).float() - reference.float()).abs().max())
                    except Exception as exc:  # past the GPU's shared memory or registers: not a candidate
                        failed.append(f"{tuple(config)}: {type(exc).__name__}")
                        continue
                    if error > tolerance:
                        failed.append(f"{tuple(config)}: max error {error:.3g} > {tolerance:.3g}")
                        continue
                    us = time_us(lambda: run(config))
                    tried += 1
                    if config == default:
                        default_us = us
                    if us < best_us:
                        best_us, best = us, config
                if best is None:
                    raise SystemExit(f"{fmt} {n}x{k} M={m}: no config matched the reference: {failed[:3]}")
                tiled_us = time_us(tiled) if tiled is not None else float("nan")
                dense_us = time_us(lambda: torch.nn.functional.linear(x, dense_weight))
                share = weight_bytes / (best_us * 1e-6) / bandwidth
                row = {"format": fmt, "n": n, "k": k, "m": m, "default": list(default), "default_us": default_us,
                       "best": list(best), "best_us": best_us, "tiled_us": tiled_us, "bf16_linear_us": dense_us,
                       "weight_bytes": weight_bytes, "best_share_of_copy_bandwidth": share, "tried": tried,
                       "failed": failed}
                rows.append(row)
                write_record()
                tables.setdefault((fmt, n, k), []).append((m, best))
                print(f"{fmt:<12} {f'{n}x{k}':>12} {m:>3} {default_us:>10.1f} {best_us:>8.1f} {tiled_us:>8.1f} "
                      f"{dense_us:>8.1f} {share:>8.0%} {tried:>5}  {tuple(best)}", flush=True)

    for fmt in args.formats.split(","):
        ones = [r for r in rows if r["format"] == fmt and r["m"] == 1]
        if len(ones) == len(shapes) and 1 in row_counts:
            step_us = args.layers * sum(r["best_us"] for r in ones)
            floor_us = args.layers * sum(r["weight_bytes"] for r in ones) / bandwidth * 1e6
            print(f"{fmt}: batch-1 step's {4 * args.layers if len(shapes) == 4 else len(shapes) * args.layers} "
                  f"projections {step_us / 1000:.2f} ms at the best configs (weight bytes at copy bandwidth: "
                  f"{floor_us / 1000:.2f} ms)")

    print(f"\n# {gpu}, {num_sms} SMs (benchmarks/tune_w4a16.py)")
    for (fmt, n, k), best_by_rows in tables.items():
        covers = [(m if following is not None else 16, config) for (m, config), following
                  in zip(best_by_rows, best_by_rows[1:] + [None])]
        key = ((n, k, GROUP_SIZE) if fmt == "w4a16" else (n, k) if fmt == "w16"
               else (n, k, (128, 128) if fmt == "fp8_block" else None))
        table = {"w4a16": "TUNED_SKINNY", "w16": "TUNED_16BIT"}.get(fmt, "TUNED")
        if fmt == "fp8_tensor":  # the same kernel and key as per channel: its row is a check, not a table entry
            continue
        print(f"{table}[{key}] = [" + ", ".join(f"({cover}, SkinnyConfig{tuple(config)})"
                                                 for cover, config in covers) + "]")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
