"""How many long requests of a sliding-window model run at once in one memory budget: every layer keeping every
token's KV (`--disable-hybrid-swa-memory`) against window slots freed as positions leave the windows, at a few
`--swa-full-tokens-ratio` values.

    python benchmarks/swa_memory.py                                    # CPU, a small Gemma 3 shape, random weights
    bash benchmarks/gpu_swa.sh                                         # the Gemma 3 4B shape on a GPU

A real Scheduler in-process (tests/scheduler_driver.py, no ZMQ), the same `--max-total-tokens` for every layout (the
memory of that many tokens under the full layout; the window-aware layouts split those bytes, model_runner/
swa_memory.py), `--num-requests` prompts of `--prompt-len` random tokens submitted at once, greedy. Per layout: the
full and window slots, the most requests running at once, wall time, output tokens per second, and whether the
output ids equal the full layout's. Prints a table with the CPU's ISA flags and writes a JSON record (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _srcpath import ROOT  # importing it maps radixserve.<folder> onto the checkout

sys.path.insert(0, str(ROOT / "tests"))  # the in-process scheduler driver

import torch  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from scheduler_driver import SchedulerDriver  # noqa: E402

# A small Gemma 3 shape for the CPU: five sliding layers to one full (Gemma 3's pattern), Gemma 3 1B's heads.
SMALL_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64, "sliding_window": 64,
    "sliding_window_pattern": 6, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "float32",
}


def run_layout(model_dir: str, prompts: list[list[int]], max_new_tokens: int, server_args: dict) -> dict:
    driver = SchedulerDriver(model_dir, check_every_step=False, load_format="dummy", **server_args)
    allocator = driver.runner.allocator
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    most = 0
    start = time.perf_counter()
    while not driver.scheduler.is_idle():
        driver.step()
        most = max(most, len(driver.scheduler.running))
    wall = time.perf_counter() - start
    driver.scheduler.check_invariants()
    outputs = [driver.results[f"r{i}"].output_ids for i in range(len(prompts))]
    row = dict(full_slots=allocator.size, window_slots=getattr(allocator, "window_size", 0), max_running=most,
               wall_s=wall, output_tokens_per_s=sum(len(o) for o in outputs) / wall,
               retractions=driver.scheduler.stats.num_retractions)
    driver.close()
    return row | {"outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a config.json (random weights); default: a small Gemma 3")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-total-tokens", type=int, default=1200)
    parser.add_argument("--chunked-prefill-size", type=int, default=256)
    parser.add_argument("--ratios", default="0.8,0.25", help="--swa-full-tokens-ratio values to run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "swa_memory.json"))
    args = parser.parse_args()

    config = json.loads(Path(args.config).read_text()) if args.config else SMALL_GEMMA3
    workdir = tempfile.mkdtemp(prefix="swa-memory-")
    try:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config, f)
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, config["vocab_size"], (args.prompt_len,), generator=generator).tolist()
                   for _ in range(args.num_requests)]
        common = dict(device=args.device, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                      chunked_prefill_size=args.chunked_prefill_size, max_running_requests=args.num_requests,
                      context_length=args.prompt_len + args.max_new_tokens + 8, disable_overlap_schedule=True)
        if args.device == "cpu":
            common["cpu_kernels"] = "auto"
        if args.attention_backend:
            common["attention_backend"] = args.attention_backend
        layouts = [("full layout", dict(disable_hybrid_swa_memory=True))]
        layouts += [(f"window slots, ratio {r}", dict(swa_full_tokens_ratio=float(r))) for r in args.ratios.split(",")]
        rows = []
        for name, extra in layouts:
            row = run_layout(workdir, prompts, args.max_new_tokens, common | extra)
            rows.append(dict(layout=name, **row))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    full_outputs, full_running = rows[0]["outputs"], rows[0]["max_running"]
    for row in rows:
        row["same_ids"] = row.pop("outputs") == full_outputs
        row["concurrency_vs_full"] = row["max_running"] / full_running
    record = dict(cpu_isa=cpu_build.cpu_isa(), threads=torch.get_num_threads(), device=args.device,
                  dtype=args.dtype, window=config.get("sliding_window"), num_requests=args.num_requests,
                  prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                  max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill_size,
                  command=" ".join(sys.argv), results=rows)
    print(f"{args.device}, CPU {record['cpu_isa']}, {record['threads']} threads, {args.dtype}, window "
          f"{record['window']}, {args.num_requests} requests x {args.prompt_len} + {args.max_new_tokens} tokens, "
          f"memory of {args.max_total_tokens} full-layout tokens")
    print(f"{'layout':28} {'full slots':>10} {'window slots':>12} {'max running':>11} {'x full':>6} "
          f"{'out tok/s':>9} {'wall s':>7} {'same ids':>8}")
    for row in rows:
        print(f"{row['layout']:28} {row['full_slots']:>10} {row['window_slots']:>12} {row['max_running']:>11} "
              f"{row['concurrency_vs_full']:>6.2f} {row['output_tokens_per_s']:>9.1f} {row['wall_s']:>7.1f} "
              f"{str(row['same_ids']):>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
