"""GPU check of sliding-window attention: FlashInfer (window_left) and compiled Triton against a float64 reference
with the window's mask, then one decode layer's time with and without a window. One command on the GPU host:

    python benchmarks/sliding_window_gpu.py     # writes $OUT/sliding_window_gpu.json when OUT is set (else --out)

Correctness: DECODE, EXTEND (cached prefixes longer and shorter than the window) and MIXED batches, page sizes 1 and
16, the Gemma 3 head layout (8 query heads, 4 KV heads, head_dim 256) and a GQA-4 layout of head_dim 128, windows of
32 and 512, bfloat16. Every position that no query of its request sees points at a slot full of NaN
(tests/attention_cases.py), so a backend that reads one fails the check. Timing: one decode layer over 64 requests
of 8,192 positions, full attention against a window of 1,024 (the window reads an eighth of the keys), median of
CUDA-event timings after warm-up. The exit status is 1 if any check failed.

With `--model-run`, then the Gemma 3 4B text shape with random bf16 weights through the ModelRunner (five sliding
layers of window 1,024 to one full layer, benchmarks/configs/gemma-3-4b.json): benchmarks/one_batch.py's prefill and
decode tables, its decode at 4,096 positions a request, past the window.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import traceback
from pathlib import Path

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(ROOT / ".gpu-cache"))

import torch  # noqa: E402

from attention_cases import make_case, poison_outside_windows, reference_attention, run_backend  # noqa: E402
from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

DEVICE = "cuda"
LAYOUTS = [(8, 4, 256), (32, 8, 128)]  # (heads, KV heads, head_dim): Gemma 3 4B's, and a Llama-like GQA 4
WINDOWS = [32, 512]
PAGE_SIZES = [1, 16]
TOLERANCE = 2e-2  # max abs error vs the float64 reference, bfloat16


def lengths(mode: ForwardMode, rng: random.Random) -> tuple[list[int], list[int]]:
    if mode == ForwardMode.DECODE:
        prefixes = [0, 5, 31, 511, 512, 513] + [rng.randint(1, 3000) for _ in range(10)]
        return prefixes, [1] * len(prefixes)
    if mode == ForwardMode.MIXED:
        return [rng.randint(1, 900) for _ in range(4)] + [0, 40], [1] * 4 + [rng.randint(2, 700), 300]
    return [0, 0, 16, rng.randint(1, 1500), 700, 33], [rng.randint(1, 900), 1, 600, rng.randint(1, 400), 1, 64]


def make_backend(name: str, heads: int, kv_heads: int, head_dim: int, page_size: int, window: int):
    if name == "triton":
        return TritonAttentionBackend(heads, kv_heads, head_dim, DEVICE, max_batch_size=256)
    from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(heads, kv_heads, head_dim, torch.bfloat16, DEVICE, page_size=page_size,
                                      sliding_windows=(window,))


def check(rows: list[dict]) -> None:
    for heads, kv_heads, head_dim in LAYOUTS:
        for page_size in PAGE_SIZES:
            for window in WINDOWS:
                for mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED):
                    seed = head_dim + page_size + window + mode.value
                    lens = lengths(mode, random.Random(seed))
                    for name in ("flashinfer", "triton"):
                        row = dict(check="window", backend=name, heads=f"{heads}/{kv_heads}x{head_dim}",
                                   page_size=page_size, window=window, mode=mode.name)
                        try:
                            case = make_case(mode, *lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                             page_size=page_size, dtype=torch.bfloat16, device=DEVICE, seed=seed)
                            expected = reference_attention(case, device=DEVICE, sliding_window=window)
                            poison_outside_windows(case, window)
                            backend = make_backend(name, heads, kv_heads, head_dim, page_size, window)
                            out = run_backend(backend, case, window)
                            torch.cuda.synchronize()
                            row["err_vs_ref"] = (out.double() - expected).abs().max().item()
                            row["ok"] = row["err_vs_ref"] <= TOLERANCE
                        except Exception as exc:  # report and go on: one run shows every failure
                            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                        rows.append(row)


def _median_ms(fn, iters: int = 30) -> float:
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
    return sorted(times)[len(times) // 2]


def time_decode(rows: list[dict]) -> None:
    heads, kv_heads, head_dim, window, page_size = 8, 4, 256, 1024, 16
    case = make_case(ForwardMode.DECODE, [8191] * 64, [1] * 64, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, page_size=page_size, dtype=torch.bfloat16, device=DEVICE,
                     keep_reference_data=False)
    for name in ("flashinfer", "triton"):
        backend = make_backend(name, heads, kv_heads, head_dim, page_size, window)
        backend.plan(case.batch)
        for label, w in (("full", None), (f"window {window}", window)):
            ms = _median_ms(lambda: backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch,
                                                    w))
            rows.append(dict(check="decode_time", backend=name, attention=label, ms=ms, ok=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--model-run", action="store_true", help="also run the Gemma 3 4B shape (one_batch.py)")
    args = parser.parse_args()
    if args.model_run:
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "one_batch.py"), "--config",
                        str(ROOT / "benchmarks" / "configs" / "gemma-3-4b.json"), "--dtype", "bfloat16",
                        "--prefill-batch-sizes", "1,8", "--input-len", "2048", "--decode-batch-sizes", "1,16,64",
                        "--context-len", "4096", "--out", args.out], check=False)
    rows: list[dict] = []
    check(rows)
    try:
        time_decode(rows)
    except Exception as exc:
        rows.append(dict(check="decode_time", ok=False, error=f"{type(exc).__name__}: {exc}"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = dict(device=torch.cuda.get_device_name(), rows=rows)
    (Path(args.out) / "sliding_window_gpu.json").write_text(json.dumps(record, indent=1))
    print(f"{'check':12} {'backend':10} {'case':44} {'result':>12}")
    for row in rows:
        if row["check"] == "window":
            case = f"{row['heads']} page {row['page_size']} W {row['window']} {row['mode']}"
            result = f"{row.get('err_vs_ref', float('nan')):.2e}" if "error" not in row else row["error"][:40]
        else:
            case, result = row.get("attention", ""), f"{row['ms']:.3f} ms" if "ms" in row else row.get("error", "")
        print(f"{row['check']:12} {row.get('backend', ''):10} {case:44} {result:>12} {'' if row['ok'] else 'FAIL'}")
    sys.exit(0 if all(row["ok"] for row in rows) else 1)


if __name__ == "__main__":
    main()
