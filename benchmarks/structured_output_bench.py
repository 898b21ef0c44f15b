"""Throughput cost of a JSON-schema constraint: the same batch with and without it, on an in-process Engine.

Both workloads send N chat requests at once (greedy) and count output tokens per second of wall time:

- `none`: unconstrained, `--output-len` tokens each (EOS ignored, so every request runs to the end);
- `json_schema`: constrained to a JSON array of exactly `--items` integers in [100, 999]; the model cannot
  stop before the array is complete, so outputs are long and of similar length (their real token count is
  what is measured, and `--output-len` caps them).

Each is run `--repeats` times after a warm-up (which also compiles the grammar once, so the runs measure
masked decoding, not compilation) and the best run is kept, once with the overlap scheduler on and once off.
The grammar's own costs are reported too: the first compilation of the schema and a cached lookup.

    python benchmarks/structured_output_bench.py --num-requests 32 --output-len 64 --items 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _srcpath  # noqa: E402,F401


def schema_of(items: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
            "minItems": items, "maxItems": items}


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    topics = ["cats", "rivers", "planets", "cars", "trees", "songs", "cities", "books"]
    return [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List some numbers about {topics[i % len(topics)]} (request {i})."}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for i in range(count)]


def run_once(engine: Any, prompts: list[list[int]], params: dict[str, Any],
             items: int = 0) -> tuple[float, int, int]:
    """(seconds, output tokens, requests that finished on their own) for one batch; a constrained output that
    finished must be an array of `items` integers."""
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(r["output_ids"]) for r in results)
    stopped = [r for r in results if r["meta_info"]["finish_reason"]["type"] == "stop"]
    if items:
        assert all(len(json.loads(r["text"])) == items for r in stopped), "a constrained output broke its schema"
    return seconds, tokens, len(stopped)


def grammar_costs(tokenizer: Any, vocab_size: int, eos: list[int], schema: str,
                  batch_size: int) -> dict[str, float]:
    """Seconds taken by the grammar machinery alone: compiler set-up, one compilation, a cached lookup, and
    per decode step the mask of one request (fill) and of a batch of `batch_size` (apply to the logits)."""
    import torch
    import xgrammar

    from radixserve.scheduler.grammar import GrammarCache, GrammarState

    cache = GrammarCache(tokenizer, vocab_size, eos)
    costs: dict[str, float] = {}
    start = time.perf_counter()
    cache.get(("json_schema", '{"type": "object"}')).result()
    costs["compiler_setup_s"] = time.perf_counter() - start  # tokenizer tables, built at the first compilation
    start = time.perf_counter()
    compiled = cache.get(("json_schema", schema)).result()
    costs["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    cache.get(("json_schema", schema)).result()
    costs["cached_lookup_s"] = time.perf_counter() - start
    cache.shutdown()

    state = GrammarState(compiled)
    bitmask = xgrammar.allocate_token_bitmask(batch_size, vocab_size)
    steps = 0
    start = time.perf_counter()
    for token in tokenizer.encode("[" + ", ".join(["123"] * 8)):
        state.fill(bitmask, 0)
        state.accept(token)
        steps += 1
    costs["fill_per_request_step_s"] = (time.perf_counter() - start) / steps
    logits = torch.randn(batch_size, vocab_size)
    start = time.perf_counter()
    for _ in range(20):
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=list(range(batch_size)))
    costs["apply_per_batch_step_s"] = (time.perf_counter() - start) / 20
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--items", type=int, default=10, help="integers in the constrained JSON array")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--overlap", default="on,off", help="comma-separated: on, off")
    parser.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    from radixserve import Engine

    schema = json.dumps(schema_of(args.items))
    workloads = {
        "none": {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True},
        "json_schema": {"max_new_tokens": args.output_len, "temperature": 0.0, "json_schema": schema},
    }
    rows: list[dict[str, Any]] = []
    costs: dict[str, float] = {}
    for overlap in args.overlap.split(","):
        with Engine(log_level="warning", disable_overlap_schedule=overlap == "off") as engine:
            prompts = chat_prompts(engine.tokenizer, args.num_requests)
            if not costs:
                info = engine.model_info
                costs = grammar_costs(engine.tokenizer, info.vocab_size, list(info.eos_token_ids), schema,
                                      args.num_requests)
            for name, params in workloads.items():
                run_once(engine, prompts[:4], {**params, "max_new_tokens": 4})  # warm-up, compiles the grammar
                items = args.items if "json_schema" in params else 0
                best = min((run_once(engine, prompts, params, items) for _ in range(args.repeats)),
                           key=lambda r: r[0] / max(r[1], 1))
                seconds, tokens, stopped = best
                rows.append({"overlap": overlap, "workload": name, "seconds": seconds, "output_tokens": tokens,
                             "tokens_per_s": tokens / seconds, "finished_by_grammar": stopped})
                print(f"overlap {overlap:3s} {name:12s} {tokens:6d} tokens in {seconds:6.2f} s = "
                      f"{tokens / seconds:7.1f} tok/s  ({stopped}/{len(prompts)} stopped on their own)", flush=True)
    for overlap in args.overlap.split(","):
        by_name = {r["workload"]: r for r in rows if r["overlap"] == overlap}
        ratio = by_name["json_schema"]["tokens_per_s"] / by_name["none"]["tokens_per_s"]
        print(f"overlap {overlap}: json_schema runs at {ratio:.2f}x the unconstrained throughput")
    print("grammar: " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in costs.items()))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "grammar": costs}, f, indent=2)


if __name__ == "__main__":
    main()
