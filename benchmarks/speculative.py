"""Speculative decoding on vs off: output tokens/s and acceptance on a copy-heavy workload and on random prompts.

Two in-process Engines on the embedded model (or `--model`), plain decoding and `--speculative-algorithm NGRAM`
with `--speculative-num-draft-tokens` from `--num-draft-tokens`, run each workload's prompts greedily at batch
size 1 (one request at a time, the latency case speculation is for) and, with `--batch-size N`, N at a time.
Each batch runs on one engine and then the other, so load from other work on a shared machine weighs on both
alike. Startup and one warm-up request are excluded from the timing.

Workloads (chat prompts to the instruct model, EOS ends a request; at most `--max-new-tokens` outputs):
- `copy-edit`: "rewrite this code with one change" over source files of this repository (the output copies
  most of its input);
- `copy-quote`: "summarize, quoting the key sentences verbatim" over sections of the repository's README;
- `random`: short open-ended questions (little to copy; measures the cost of verifying drafts that fail).

Printed: a table per workload and setting (output tokens/s over the whole requests, prefill included, and the
speed-up over plain; output tokens per CPU-second of the engine's processes and that speed-up, the figure to
read on a machine shared with other work, best with `OMP_NUM_THREADS=1` so no thread spins waiting for a core;
mean accept length =
output tokens per verify step, accept rate of drafts, and whether the greedy outputs are identical to plain
decoding's), with the CPU's ISA; `--out PATH` writes the same as a JSON record. `--repeats N` runs every workload
N times (caches flushed before each run) and reports totals, which steadies the figures on a shared machine.

    OMP_NUM_THREADS=1 python benchmarks/speculative.py --max-new-tokens 96 --repeats 3 \
        --out docs/results/speculative_cpu.json
    python benchmarks/speculative.py --verify-cost   # one verify forward's CPU time by chain length
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _srcpath  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Name three uses of a paperclip.", "Why is the sky blue?", "Write a haiku about rain.",
             "What makes a good password?"]


@dataclass
class Measurement:
    workload: str
    setting: str
    batch_size: int
    seconds: float = 0.0  # wall time of the generate calls (prefill included)
    cpu_seconds: float = 0.0  # CPU time the engine's processes spent in them (robust to a shared machine)
    output_tokens: int = 0
    verify_steps: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cpu_second(self) -> float:
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def accept_length(self) -> Optional[float]:
        return self.output_tokens / self.verify_steps if self.verify_steps else None

    @property
    def accept_rate(self) -> Optional[float]:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else None

    def add(self, outs: list[dict], seconds: float, cpu_seconds: float) -> None:
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds
        for out in outs:
            meta = out["meta_info"]
            self.output_tokens += meta["completion_tokens"]
            self.verify_steps += meta.get("spec_verify_ct", 0)
            self.accepted_drafts += meta.get("spec_accept_token_num", 0)
            self.proposed_drafts += meta.get("spec_draft_token_num", 0)
            self.outputs.append(out["output_ids"])


def chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    return tokenizer.encode(prompt)


def workloads(tokenizer, num_prompts: int) -> dict[str, list[list[int]]]:
    code_files = ["scheduler/speculative/ngram.py", "scheduler/stats.py", "scheduler/output.py",
                  "radix_cache/pool.py"]
    edits = []
    for path in code_files[:num_prompts]:
        code = (ROOT / path).read_text()[:1500]
        edits.append(chat(tokenizer, "Rewrite this Python code exactly, but rename every `self` to `this`:\n\n"
                          f"```python\n{code}\n```"))
    design = (ROOT / "README.md").read_text()
    sections = [design[i: i + 1200] for i in range(0, len(design), 1200)][1: 1 + num_prompts]
    quotes = [chat(tokenizer, "Summarize this text, quoting its two most important sentences word for word:\n\n"
                   + section) for section in sections]
    return {"copy-edit": edits, "copy-quote": quotes,
            "random": [chat(tokenizer, q) for q in QUESTIONS[:num_prompts]]}


def run_settings(settings: dict[str, dict[str, Any]], prompts_by_workload: dict[str, list[list[int]]],
                 max_new_tokens: int, batch_sizes: list[int], repeats: int = 1) -> list[Measurement]:
    """Every setting's Engine at once, each batch run under each setting in turn: on a shared machine, load that
    comes and goes then weighs on every setting alike. With `repeats`, every workload runs that many times (the
    caches flushed before each), and the figures are totals over the runs."""
    from contextlib import ExitStack

    import psutil

    from radixserve import Engine

    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    results = []

    def descendants() -> set[int]:
        return {child.pid for child in psutil.Process().children(recursive=True)}

    def cpu_times(pids: set[int]) -> dict[int, float]:
        """CPU seconds so far of each of `pids` still running, by pid."""
        times = {}
        for pid in pids:
            try:
                process_times = psutil.Process(pid).cpu_times()
                times[pid] = process_times.user + process_times.system
            except psutil.NoSuchProcess:
                pass
        return times

    def cpu_spent(before: dict[int, float], pids: set[int]) -> float:
        """CPU seconds the processes spent since `before`; a process that ended meanwhile (a short-lived helper
        of the engine's) counts nothing rather than minus its earlier time."""
        after = cpu_times(pids)
        return sum(after[pid] - before.get(pid, 0.0) for pid in after)

    import torch

    if not torch.cuda.is_available():
        from radixserve.kernels import cpu_build

        # Build (or load) the CPU kernels here first: most often the engines then find an up-to-date build, and a
        # build that cannot finish (a stale lock in the build directory) stops the benchmark here instead of
        # leaving the engines on the torch path. `wait_for_kernel_builds` covers the engines' own builds.
        cpu_build.load()
    with ExitStack() as stack:
        engines, processes = {}, {}
        for name, engine_args in settings.items():
            before = descendants()
            engines[name] = stack.enter_context(Engine(log_level="warning", **engine_args))
            processes[name] = descendants() - before
        wait_for_kernel_builds(descendants)
        for engine in engines.values():
            engine.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 4})  # warm-up
        for workload, prompts in prompts_by_workload.items():
            for batch_size in batch_sizes:
                measurements = {name: Measurement(workload, name, batch_size) for name in settings}
                for _ in range(repeats):
                    for engine in engines.values():
                        engine.flush_cache()  # no run may reuse another's prefill (or its tokens as drafts)
                    for start in range(0, len(prompts), batch_size):
                        batch = prompts[start: start + batch_size]
                        for name, engine in engines.items():
                            began, cpu_began = time.perf_counter(), cpu_times(processes[name])
                            outs = engine.generate(input_ids=batch, sampling_params=params)
                            measurements[name].add(outs, time.perf_counter() - began,
                                                   cpu_spent(cpu_began, processes[name]))
                results.extend(measurements.values())
    return results


def wait_for_kernel_builds(descendants, timeout: float = 600.0) -> None:
    """Wait until no engine process is compiling the CPU kernels. An engine that finds no build of its checkout's
    kernel sources compiles them in the background and serves on the torch path meanwhile; timing it then would
    count the compiler and the slower path."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = set()
        for pid in descendants():
            try:
                names.add(psutil.Process(pid).name())
            except psutil.NoSuchProcess:
                pass
        if not names & {"ninja", "cc1plus", "c++", "g++", "ld"}:
            time.sleep(2.0)  # the library loads right after its build
            return
        time.sleep(1.0)


def verify_cost(model: Optional[str], context_len: int, chain_lens: list[int], repeats: int) -> list[dict]:
    """CPU time of one verify forward by chain length (1 = a plain decode step), on one torch thread, with three
    choices of float32 linears (model_runner/cpu/small_batch.py): `F.linear` for every row count; the packed
    weights from the dispatch table's `packed_from` rows without the small-row kernel (what speculative decoding ran
    before the kernel); and the linears as the runner installs them (the kernel in its rows, the packed weights past them):
    what a chain of drafts costs next to the decode step it replaces. The CPU kernels (attention, norms) are loaded
    first, as a serving engine has them; chain lengths are timed in turn, round after round, so load from other
    work weighs on all alike."""
    import statistics

    import torch

    from radixserve.kernels import cpu_build
    from radixserve.model_runner.cpu.dispatch import NO_ROWS
    from radixserve.model_runner.cpu.small_batch import SmallBatchLinear
    from radixserve.model_runner.forward_batch import ForwardMode
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
    from radixserve.runtime.wire.server_args import ServerArgs

    torch.set_num_threads(1)
    args = ServerArgs(log_level="warning", device="cpu", speculative_algorithm="NGRAM",
                      **({"model_path": model} if model else {}))
    runner = ModelRunner(RunnerConfig.from_server_args(args))
    kernels = cpu_build.load()
    row = runner.req_to_token_pool.alloc()
    prompt = [(7 * i) % runner.vocab_size for i in range(context_len)]
    slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, [row], [0], [context_len])
    runner.forward(make_forward_batch(ForwardMode.EXTEND, [row], [0], [prompt], slots, runner.req_to_token_pool,
                                      runner.token_to_kv_pool))
    chain_slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, [row], [context_len],
                                  [max(chain_lens)])
    route = runner.cpu_kernels.linear(torch.float32)
    packed_from, (low, high) = route.packed_from, route.small
    linears = [m for m in runner.model.modules() if isinstance(m, SmallBatchLinear)]
    installed = {id(m): (m.kernel_rows, m.packed_from) for m in linears}
    # name -> (first packed row count, whether the small-row kernel runs)
    variants = {"F.linear": (sys.maxsize, False),
                f"packed from {packed_from} rows": (packed_from, False),
                f"kernel {low}-{high} rows, packed past": (packed_from, True)}
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in variants for n in chain_lens}
    try:
        for _ in range(repeats + 1):
            for name, (min_rows, kernel) in variants.items():
                for module in linears:  # read by SmallBatchLinear at every call
                    module.packed_from = min_rows
                    module.kernel_rows = installed[id(module)][0] if kernel else NO_ROWS
                for length in chain_lens:
                    mode = ForwardMode.DECODE if length == 1 else ForwardMode.EXTEND
                    batch = make_forward_batch(mode, [row], [context_len], [prompt[:length]],
                                               chain_slots[:length], runner.req_to_token_pool,
                                               runner.token_to_kv_pool, logits_indices=torch.arange(length))
                    began = time.process_time()
                    runner.forward(batch)
                    times[(name, length)].append(time.process_time() - began)
    finally:
        for module in linears:
            module.kernel_rows, module.packed_from = installed[id(module)]
    return [{"linears": name, "chain_len": length, "context_len": context_len, "cpu_kernels": kernels,
             "cpu_ms": 1000 * statistics.median(samples[1:])} for (name, length), samples in times.items()]


def cpu_description() -> dict[str, Any]:
    import torch

    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            if model and flags:
                break
    except OSError:
        pass
    isa_flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "isa_flags": isa_flags,
            "torch_threads": torch.get_num_threads(), "logical_cores": os.cpu_count(),
            "load_average": os.getloadavg()}


def record_text(record: dict) -> str:
    """The JSON record, indented, with each recorded token list on one line."""
    greedy = record.pop("greedy_outputs")
    text = json.dumps(record, indent=2)[:-2]
    pairs = ",\n".join(f'    "{name}": {json.dumps(value)}' for name, value in greedy.items())
    return f'{text},\n  "greedy_outputs": {{\n{pairs}\n  }}\n}}\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=6, help="--speculative-num-draft-tokens")
    parser.add_argument("--batch-size", type=int, action="append", default=None,
                        help="requests run together (repeatable; default: 1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every workload this many times and report totals (steadier on a shared machine)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--verify-cost", action="store_true",
                        help="only time one verify forward by chain length (F.linear, packed, kernel linears) and exit")
    args = parser.parse_args()
    if args.verify_cost:
        costs = verify_cost(args.model, 400, [1, 2, 3, 4, 5, 6, 8, 10, 12], repeats=9)
        print(f"{'linears':<32} {'chain':>5} {'CPU ms':>7} {'vs decode':>9}")
        for row in costs:
            decode = next(r["cpu_ms"] for r in costs if r["linears"] == row["linears"] and r["chain_len"] == 1)
            print(f"{row['linears']:<32} {row['chain_len']:>5} {row['cpu_ms']:>7.1f} {row['cpu_ms'] / decode:>8.2f}x")
        if args.out:
            Path(args.out).write_text(json.dumps({"benchmark": "speculative verify cost",
                                                  "machine": cpu_description(), "rows": costs}, indent=2) + "\n")
        return
    batch_sizes = args.batch_size or [1]

    from radixserve.runtime.model_files import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model).model_dir)
    prompts = workloads(tokenizer, args.num_prompts)
    base = {"model_path": args.model} if args.model else {}
    spec_name = f"ngram-{args.num_draft_tokens}"
    settings = {"off": base, spec_name: {**base, "speculative_algorithm": "NGRAM",
                                         "speculative_num_draft_tokens": args.num_draft_tokens}}
    measured = run_settings(settings, prompts, args.max_new_tokens, batch_sizes, args.repeats)
    plain, spec = measured[0::2], measured[1::2]

    machine = cpu_description()
    print(f"CPU: {machine['cpu']} (ISA {machine['isa']}, flags {' '.join(machine['isa_flags'])}, "
          f"{machine['torch_threads']} torch threads, "
          f"load average {machine['load_average'][0]:.1f})")
    header = f"{'workload':<11} {'setting':<9} {'bs':>3} {'tok/s':>7} {'speed-up':>8} {'tok/CPU-s':>9} " \
             f"{'speed-up':>8} {'accept len':>10} {'accept rate':>11} {'same ids':>8}"
    print(header)
    print("-" * len(header))
    rows = []
    for off, on in zip(plain, spec):
        for m in (off, on):
            speedup = m.tokens_per_second / off.tokens_per_second if off.tokens_per_second else 0.0
            cpu_speedup = m.tokens_per_cpu_second / off.tokens_per_cpu_second if off.tokens_per_cpu_second else 0.0
            same = m.outputs == off.outputs
            length = f"{m.accept_length:.2f}" if m.accept_length else "-"
            rate = f"{m.accept_rate:.2f}" if m.accept_rate is not None else "-"
            print(f"{m.workload:<11} {m.setting:<9} {m.batch_size:>3} {m.tokens_per_second:>7.2f} {speedup:>7.2f}x "
                  f"{m.tokens_per_cpu_second:>9.2f} {cpu_speedup:>7.2f}x {length:>10} {rate:>11} {str(same):>8}")
            row = {k: v for k, v in asdict(m).items() if k != "outputs"}
            row.update(tokens_per_second=m.tokens_per_second, speedup=speedup,
                       tokens_per_cpu_second=m.tokens_per_cpu_second, cpu_speedup=cpu_speedup,
                       accept_length=m.accept_length,
                       accept_rate=m.accept_rate, identical_to_plain=same)
            rows.append(row)
    greedy = {name: [[prompt, output] for prompt, output in zip(prompts[name], m.outputs)]
              for name, m in ((m.workload, m) for m in plain if m.batch_size == batch_sizes[0])}
    record = {"benchmark": "speculative", "machine": machine, "model": args.model or "embedded SmolLM2-135M-Instruct",
              "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
              "num_prompts": args.num_prompts, "repeats": args.repeats, "results": rows,
              "greedy_outputs": greedy}  # prompt and plain greedy output ids (benchmarks/speculative_rules.py)
    if args.out:
        Path(args.out).write_text(record_text(record))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
