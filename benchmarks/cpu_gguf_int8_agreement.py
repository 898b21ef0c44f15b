"""How far the GGUF blocks' int8 activations (`--gguf-activations int8`) move the embedded model's greedy output from
the float32 path: 16 prompts x 32 greedy tokens on the float32 conversion (`--dtype float32`, the reference), on the blocks
with float32 activations (`--quantization gguf`) and on the blocks with int8 activations; and, for scale, on the
bfloat16 conversion (`--dtype bfloat16`), the other path that rounds what the float32 path computes.

    python benchmarks/cpu_gguf_int8_agreement.py [--out FILE]

Per path against the reference: the prompts whose 32 tokens are all the same, the mean length of the common prefix,
and over the tokens of the common prefixes the distance of the chosen tokens' logprobs (mean and max |difference|).
A real Scheduler and ModelRunner in this process (the tests' scheduler driver), the 16 requests decoding together
(as in a server). The blocks keep keys and values in float16 by default; "gguf, float32 KV" is the same path with a
float32 cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from scheduler_driver import SchedulerDriver  # noqa: E402

from radixserve.kernels import cpu_build  # noqa: E402
from radixserve.runtime.model_files import load_tokenizer, resolve_model  # noqa: E402
from radixserve.runtime.wire.model_files import default_model_path  # noqa: E402

PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8,", "Water boils at", "The quick brown fox", "In 1492, Columbus", "import numpy as np\n",
    "My favourite food is", "The theory of relativity says", "Here is a list of fruits:", "Dear Sir or Madam,",
    "The best way to learn programming is", "SELECT * FROM", "Photosynthesis is the process", "Paris is known for",
]
PATHS = {
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},  # for scale: the other approximate path
    "gguf float32 activations": {"quantization": "gguf"},  # keys and values in float16 (its default)
    "gguf, float32 KV": {"quantization": "gguf", "kv_cache_dtype": "float32"},
    "gguf int8 activations": {"quantization": "gguf", "gguf_activations": "int8"},
    "gguf int8, bfloat16 KV": {"quantization": "gguf", "gguf_activations": "int8", "kv_cache_dtype": "bfloat16"},
    "gguf, bfloat16 KV": {"quantization": "gguf", "kv_cache_dtype": "bfloat16"},
}
NEW_TOKENS = 32


def generate(settings: dict, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs, on one path."""
    driver = SchedulerDriver(default_model_path(), check_every_step=False, cpu_kernels="auto", **settings)
    cpu_build.wait()
    for i, prompt in enumerate(prompts):
        driver.submit(f"p{i}", prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
    results = driver.run_until_idle()
    driver.close()
    return [(results[f"p{i}"].output_ids, results[f"p{i}"].logprobs) for i in range(len(prompts))]


def compare(reference: list, ours: list) -> dict:
    prefixes, distances = [], []
    for (ref_ids, ref_lps), (ids, lps) in zip(reference, ours):
        common = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), min(len(ref_ids), len(ids)))
        prefixes.append(common)
        # the token after the common prefix too: both paths scored it from the same context
        distances += [abs(a - b) for a, b in zip(ref_lps[:common + 1], lps[:common + 1])]
    return {"prompts_identical": sum(p == NEW_TOKENS for p in prefixes), "prompts": len(prefixes),
            "mean_common_prefix": statistics.fmean(prefixes), "logprob_distance_mean": statistics.fmean(distances),
            "logprob_distance_max": max(distances)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(default_model_path()).model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    outputs = {name: generate(settings, prompts) for name, settings in PATHS.items()}
    record = {"cpu_isa": cpu_build.cpu_isa(), "cpu_flags_vnni": cpu_build.has_cpu_flag("avx512_vnni"),
              "load_average": os.getloadavg(), "new_tokens": NEW_TOKENS,
              "against_float32": {name: compare(outputs["float32"], out) for name, out in outputs.items()
                                  if name != "float32"}}
    print(f"CPU ISA {record['cpu_isa']} (avx512_vnni: {record['cpu_flags_vnni']}); {len(prompts)} prompts x "
          f"{NEW_TOKENS} greedy tokens against the float32 path")
    print(f"{'path':<28}{'identical':>10}{'mean prefix':>13}{'|dlogprob| mean':>17}{'max':>8}")
    for name, row in record["against_float32"].items():
        print(f"{name:<28}{row['prompts_identical']:>7}/{row['prompts']:<2}{row['mean_common_prefix']:>13.1f}"
              f"{row['logprob_distance_mean']:>17.5f}{row['logprob_distance_max']:>8.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
