"""DSL `run_batch` wall time with the radix cache on vs off (programs sharing a ~400-token few-shot prefix).

    .venv/bin/python benchmarks/dsl_run_batch.py                      # 64 programs, 3 timed runs per setting
    .venv/bin/python benchmarks/dsl_run_batch.py --programs 32 --repeats 1
    .venv/bin/python benchmarks/dsl_run_batch.py --method select      # score labels with select instead of gen

Workload: a few-shot sentiment classifier. Every program appends the same few-shot examples (~400 tokens),
then its own review (~20 tokens) and either `gen(max_tokens=4)` or `select` over two labels. Each setting
starts its own in-process Engine on the embedded default model (`--disable-radix-cache` for "off"), warms it
up, then times `run_batch` on a flushed cache, and reads the scheduler's prefill-token counter. With the cache
on, run_batch prefills the shared prefix once and every program computes only its own suffix; with it off,
every program computes the whole prompt.

Prints a Markdown table and writes a JSON record to benchmarks/results/dsl_run_batch_<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from radixserve.frontend import EngineBackend, function, gen, select
from radixserve.runtime.engine import Engine

EXAMPLES = [
    ("The plot was gripping from start to finish and the acting superb.", "positive"),
    ("I walked out halfway through; a dull and predictable mess.", "negative"),
    ("A warm, funny film that the whole family enjoyed together.", "positive"),
    ("The dialogue was wooden and the special effects looked cheap.", "negative"),
    ("Beautiful cinematography and a soundtrack I keep listening to.", "positive"),
    ("Two hours of my life I will never get back, sadly.", "negative"),
    ("An inspiring story told with honesty, heart and great restraint.", "positive"),
    ("The jokes fell flat and the pacing dragged terribly throughout.", "negative"),
    ("Clever twists kept me guessing until the very last scene.", "positive"),
    ("Confusing, overlong and strangely joyless despite its big budget.", "negative"),
    ("The lead performance is the best I have seen in years.", "positive"),
    ("Even the talented cast could not rescue this lazy script.", "negative"),
    ("A small gem: modest, tender and surprisingly moving overall.", "positive"),
    ("Loud, messy and forgettable; the sequel nobody asked for.", "negative"),
    ("Every frame is lovingly crafted, and the ending made me cry.", "positive"),
    ("The characters were flat and I stopped caring after ten minutes.", "negative"),
    ("A delightful surprise with a sharp script and charming leads.", "positive"),
    ("Painfully slow, with a twist you can see coming a mile away.", "negative"),
]
FEW_SHOT = ("Classify the sentiment of each movie review as positive or negative.\n\n"
            + "".join(f"Review: {text}\nSentiment: {label}\n\n" for text, label in EXAMPLES))
SUBJECTS = ["new", "old", "long", "short", "French", "quiet", "loud", "strange", "animated", "silent", "epic",
            "indie", "noir", "musical", "war", "space"]
VERDICTS = ["was wonderful", "bored me to tears", "made me laugh out loud", "was a complete disaster"]


def reviews(count: int) -> list[str]:
    return [f"Honestly, the {SUBJECTS[i % len(SUBJECTS)]} film I saw on day {i} "
            f"{VERDICTS[i // len(SUBJECTS) % len(VERDICTS)]}." for i in range(count)]


@function
def classify_gen(s, review):
    s += FEW_SHOT
    s += "Review: " + review + "\nSentiment:" + gen("label", max_tokens=4, stop="\n")


@function
def classify_select(s, review):
    s += FEW_SHOT
    s += "Review: " + review + "\nSentiment:" + select("label", [" positive", " negative"])


def measure(disable_radix_cache: bool, program, batch: list[dict], repeats: int) -> dict:
    with Engine(log_level="warning", disable_radix_cache=disable_radix_cache) as engine:
        backend = EngineBackend(engine)
        program.run_batch([{"review": "Warm-up run."}, {"review": "Another warm-up."}], backend=backend,
                          temperature=0.0)
        runs = []
        for _ in range(repeats):
            assert backend.flush_cache()
            before = backend.get_server_info()
            start = time.perf_counter()
            states = program.run_batch(batch, backend=backend, temperature=0.0)
            wall = time.perf_counter() - start
            after = backend.get_server_info()
            failed = [state.error for state in states if state.error is not None]
            if failed:
                raise failed[0]
            runs.append({
                "wall_s": wall,
                "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
                "labels": [state["label"] for state in states],
            })
        prefix_tokens = len(backend.encode(FEW_SHOT))
    wall = statistics.median(run["wall_s"] for run in runs)
    return {
        "radix_cache": not disable_radix_cache,
        "prefix_tokens": prefix_tokens,
        "wall_s_median": wall,
        "wall_s_runs": [run["wall_s"] for run in runs],
        "programs_per_s": len(batch) / wall,
        "prefill_tokens_computed": runs[-1]["prefill_tokens_computed"],
        "labels": runs[-1]["labels"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", choices=("gen", "select"), default="gen")
    args = parser.parse_args()

    program = classify_gen if args.method == "gen" else classify_select
    batch = [{"review": review} for review in reviews(args.programs)]
    results = [measure(disable, program, batch, args.repeats) for disable in (False, True)]
    on, off = results
    same = on["labels"] == off["labels"]

    print(f"\n{args.programs} programs, {args.method}, prefix {on['prefix_tokens']} tokens, "
          f"median of {args.repeats} runs\n")
    print("| radix cache | wall time (s) | programs/s | prefill tokens computed |")
    print("|---|---:|---:|---:|")
    for result in results:
        print(f"| {'on' if result['radix_cache'] else 'off'} | {result['wall_s_median']:.2f} | "
              f"{result['programs_per_s']:.1f} | {result['prefill_tokens_computed']:,} |")
    print(f"\nspeed-up {off['wall_s_median'] / on['wall_s_median']:.2f}x; "
          f"prefill tokens {off['prefill_tokens_computed'] / on['prefill_tokens_computed']:.1f}x fewer; "
          f"identical outputs: {same}")

    record = {
        "benchmark": "dsl_run_batch",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "args": vars(args),
        "identical_outputs": same,
        "results": [{k: v for k, v in result.items() if k != "labels"} for result in results],
    }
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"dsl_run_batch_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
