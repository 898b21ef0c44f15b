"""Replay n-gram proposal rules over recorded greedy outputs: accept length and an estimated decode speed-up.

Greedy verification accepts a draft exactly when it equals the next token plain decoding produces, so the drafts
a rule would have proposed, and how many of them would have been accepted, follow from the prompt and the plain
greedy output alone, without running the model. This replays the real proposer (scheduler/speculative/ngram.py)
and its draft-length rules (scheduler/speculative/state.py) with other settings over the outputs that
`benchmarks/speculative.py --out` records, and prices each verify step with the CPU times of
`benchmarks/speculative.py --verify-cost --out` (the row of the linears the runner installs: the small-row kernel's,
or the packed linears' in a record made before the kernel).

    python benchmarks/speculative_rules.py RUN.json VERIFY_COST.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _srcpath  # noqa: E402,F401

from radixserve.scheduler.speculative.state import SpecState  # noqa: E402

RULES = {  # name: (max drafts, min match window, max match window, how a proposal is sized)
    # "match": the proposer's rule (SpecState.ngram_draft_len): a full chain after a match of 2 tokens or more,
    # `max drafts` scaled by the request's acceptance average after a 1-token match. "acceptance": the earlier
    # rule, every proposal scaled by that average (SpecState.draft_len, what STANDALONE uses).
    "5 drafts, window 1-12, by match (the default)": (5, 1, 12, "match"),
    "5 drafts, window 1-12, by acceptance": (5, 1, 12, "acceptance"),
    "5 drafts, window 2-12, by acceptance": (5, 2, 12, "acceptance"),
    "5 drafts, window 3-12, by match": (5, 3, 12, "match"),
    "5 drafts, window 1-4, by match": (5, 1, 4, "match"),
    "3 drafts, window 1-12, by match": (3, 1, 12, "match"),
    "7 drafts, window 1-12, by match": (7, 1, 12, "match"),
    "7 drafts, window 1-12, by acceptance": (7, 1, 12, "acceptance"),
    "9 drafts, window 1-12, by match": (9, 1, 12, "match"),
    "11 drafts, window 1-12, by match": (11, 1, 12, "match"),
}


def replay(prompt: list[int], output: list[int], max_drafts: int, low: int, high: int,
           sizing: str) -> tuple[int, list[int]]:
    """Verify steps and the number of drafts of each step when decoding `output` after `prompt`."""
    state = SpecState(max_drafts)
    sequence, done, drafts_per_step = prompt + output[:1], 1, []
    while done < len(output):
        state.index.extend_to(sequence)
        match_len, start = state.index.longest_match(low, high)
        wanted = state.ngram_draft_len(match_len) if sizing == "match" else state.draft_len
        drafts = state.index.continuation(start, min(wanted, len(output) - done - 1))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == output[done + accepted]:
            accepted += 1
        taken = min(accepted + 1, len(output) - done)
        sequence += output[done: done + taken]
        done += taken
        drafts_per_step.append(len(drafts))
        state.on_verified(len(drafts), accepted)
    return len(drafts_per_step), drafts_per_step


def main() -> None:
    run = json.loads(open(sys.argv[1]).read())
    rows = json.loads(open(sys.argv[2]).read())["rows"]
    installed = "kernel" if any(row["linears"].startswith("kernel") for row in rows) else "packed"
    costs = {row["chain_len"]: row["cpu_ms"] for row in rows if row["linears"].startswith(installed)}

    def cost(chain_len: int) -> float:  # the nearest measured chain length at or above
        return costs[min((n for n in costs if n >= chain_len), default=max(costs))]

    print(f"{'workload':<11} {'rule':<48} {'accept len':>10} {'est. decode speed-up':>20}")
    for workload, pairs in run["greedy_outputs"].items():
        for name, (max_drafts, low, high, sizing) in RULES.items():
            steps = tokens = 0
            spec_ms = plain_ms = 0.0
            for prompt, output in pairs:
                n, drafts = replay(prompt, output, max_drafts, low, high, sizing)
                steps += n
                tokens += len(output) - 1
                spec_ms += sum(cost(1 + d) for d in drafts)
                plain_ms += (len(output) - 1) * cost(1)
            print(f"{workload:<11} {name:<48} {tokens / steps:>10.2f} {plain_ms / spec_ms:>19.2f}x")


if __name__ == "__main__":
    main()
