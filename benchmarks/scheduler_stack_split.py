"""Split a sampling profile of the scheduler process into the parts of its loop and of the model's forward.

Record the scheduler process of a running server with py-spy (not a dependency of radixserve) in its raw
("collapsed stacks") format, then split it:

    py-spy record -r 200 -f raw --nonblocking -p <scheduler pid> -d 40 -o spy.txt
    python benchmarks/scheduler_stack_split.py spy.txt

A sample counts for the first part of the loop its stack passes through (the forward, sampling, building the
batch, ...); a forward sample counts for the layer kind of its innermost radixserve frames (linear layers before
attention, since the attention module calls its own projections).
"""

from __future__ import annotations

import argparse
import collections

LOOP_PARTS = (
    ("model forward", "ModelRunner.forward"),
    ("sampling", "Sampler.sample"),
    ("forward inputs", "to_forward_batch"),
    ("processing results", "_process_result"),
    ("building batches", "get_next_batch"),
    ("sending outputs", "Socket.send"),
    ("taking outputs", "take_outputs"),
    ("handling messages", "handle_message"),
    ("waiting for work", "Poller.poll"),
)
FORWARD_PARTS = (
    ("linear layers", ("Linear", "linear", "Packed")),
    ("attention", ("ttention",)),
    ("RMSNorm, rotary, SiLU-and-mul", ("RMSNorm", "otary", "silu")),
    ("logits", ("compute_logits",)),
)
INNER_FRAMES = 3  # frames from the innermost that decide a forward sample's layer kind


def split(lines) -> tuple[int, collections.Counter, collections.Counter]:
    total, loop, forward = 0, collections.Counter(), collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        if "serve (scheduler/process.py" not in stack:
            loop["other threads"] += n
            continue
        part = next((name for name, key in LOOP_PARTS if key in stack), "rest of the loop")
        loop[part] += n
        if part == "model forward":
            inner = ";".join(stack[stack.index("ModelRunner.forward"):].split(";")[-INNER_FRAMES:])
            kind = next((name for name, keys in FORWARD_PARTS if any(k in inner for k in keys)), "rest of the forward")
            forward[kind] += n
    return total, loop, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="py-spy's raw output (-f raw)")
    args = parser.parse_args()
    with open(args.profile, encoding="utf-8") as f:
        total, loop, forward = split(f)
    print(f"{total} samples")
    for name, n in loop.most_common():
        print(f"{100 * n / total:5.1f}%  {name}")
        if name == "model forward":
            for kind, m in forward.most_common():
                print(f"        {100 * m / total:5.1f}%  {kind}")


if __name__ == "__main__":
    main()
