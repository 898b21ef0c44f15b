"""Parallel branches with `fork`: several answers explored at once, then merged.

    make serve                                   # or: radixserve serve  (http://127.0.0.1:30000)
    python examples/dsl_fork_branches.py         # another terminal
    python examples/dsl_fork_branches.py --url http://host:8000 --api-key sk-... --topic "learning a language"

`s.fork(3)` prefills the conversation so far once; the three branches then generate concurrently (their
requests batch in the server) and each finds the shared prefix in the radix cache (see cached_tokens).
"""

from __future__ import annotations

import argparse

from radixserve.frontend import (
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    set_default_backend,
    system,
    user,
)

ANGLES = ["sleep", "food", "exercise"]


@function
def advice(s, topic):
    s += system("You are a helpful assistant who answers in one or two short sentences.")
    s += user(f"I want to get better at {topic}. What should I do?")
    forks = s.fork(len(ANGLES))
    for angle, branch in zip(ANGLES, forks):
        branch += assistant(f"Regarding {angle}: " + gen("tip", max_tokens=40, stop="\n"))
    forks.join()  # s["tip"] is now the list of the branches' tips
    s += user("Summarise these tips in one sentence:\n" + "\n".join(f"- {tip.strip()}" for tip in s["tip"]))
    s += assistant(gen("summary", max_tokens=48, stop="\n"))
    for angle, branch in zip(ANGLES, forks):
        meta = branch.get_meta_info("tip")
        print(f"[{angle}] {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens came from the cache")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--topic", default="running a marathon")
    args = parser.parse_args(argv)
    set_default_backend(RuntimeEndpoint(args.url, api_key=args.api_key))

    state = advice.run(topic=args.topic, temperature=0.0)
    for angle, tip in zip(ANGLES, state["tip"]):
        print(f"{angle:>9}: {tip.strip()}")
    print(f"  summary: {state['summary'].strip()}")


if __name__ == "__main__":
    main()
