"""GPU check of release_memory_occupation / resume_memory_occupation (model_runner/memory_occupation.py): one command
on the GPU host,

    python benchmarks/gpu_memory_release.py      # writes $OUT/gpu_memory_release.json when OUT is set (else --out)

A ModelRunner on CUDA (a random-weight Llama of --hidden/--layers, bfloat16, CUDA graphs on) generates greedily;
then, for the KV pool alone and for the KV pool and the weights, it releases, reads `torch.cuda.memory_reserved`,
resumes and generates again. Checks: with the KV pool released, reserved memory is within --slack-gib of the
weights-only figure (memory allocated right after loading); with both released, within the slack of zero; after
each resume the greedy ids equal the first run's (the weights came back unchanged, the decode graphs were captured
again at the pool's new addresses). Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)

GiB = 1 << 30


def build_model(folder: str, hidden: int, layers: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                      num_key_value_heads=max(1, hidden // 512), max_position_embeddings=4096,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--slack-gib", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import greedy_generate
    from radixserve.runtime.wire.server_args import ServerArgs

    folder = tempfile.mkdtemp(prefix="memory-release-")
    build_model(folder, args.hidden, args.layers)
    server_args = ServerArgs(model_path=folder, device="cuda", dtype="bfloat16", mem_fraction_static=0.5,
                             attention_backend="triton")
    runner = ModelRunner(RunnerConfig.from_server_args(server_args))
    weights_only = runner.memory_plan.weights
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32000, (n,), generator=generator).tolist() for n in (17, 200, 5, 64)]
    expected = greedy_generate(runner, prompts, 16)
    rows = [{"state": "serving", "reserved_gib": torch.cuda.memory_reserved() / GiB, "ids_equal": True}]
    checks = []
    for tags, target in ((["kv_cache"], weights_only), (["kv_cache", "weights"], 0)):
        runner.memory.release(tags)
        reserved = torch.cuda.memory_reserved()
        runner.memory.resume(tags)
        again = greedy_generate(runner, prompts, 16)
        ok = abs(reserved - target) <= args.slack_gib * GiB and again == expected
        checks.append(ok)
        rows.append({"state": f"released {'+'.join(tags)}", "reserved_gib": reserved / GiB,
                     "target_gib": target / GiB, "ids_equal": again == expected, "ok": ok})
    print(f"{'state':<28}{'reserved GiB':>14}{'target GiB':>12}  ids after resume")
    for row in rows:
        target = f"{row['target_gib']:.2f}" if "target_gib" in row else "-"
        print(f"{row['state']:<28}{row['reserved_gib']:>14.2f}{target:>12}  {'equal' if row['ids_equal'] else 'DIFFER'}")
    record = {"device": torch.cuda.get_device_name(), "weights_gib": weights_only / GiB, "rows": rows,
              "command": " ".join(sys.argv)}
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_memory_release.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
