"""An SGLang frontend script on radixserve: only the import differs (`import radixserve as sgl`).

    python examples/dsl_sglang_script.py                  # launches its own server (sgl.Runtime), then stops it
    python examples/dsl_sglang_script.py --url http://127.0.0.1:30000 --api-key sk-...   # or use a running one

Three SGLang idioms: skeleton-of-thought (a skeleton, then `forks[i] += ...` expands every point in parallel,
each branch finding the shared prompt in the radix cache), parallel encoding (`forks += lambda i: ...`), and
typed decoding into a JSON object (`gen_int`, `gen_string`, `gen(dtype=...)` inside `s.var_scope`).
"""

from __future__ import annotations

import argparse
import json

import radixserve as sgl

NUM_POINTS = 3


@sgl.function
def skeleton_of_thought(s, topic):
    s += "USER: Give some tips for " + topic + ".\n"
    s += f"ASSISTANT: Here are {NUM_POINTS} short tips:\n"
    for i in range(1, NUM_POINTS + 1):
        s += f"{i}." + sgl.gen(f"point_{i}", max_tokens=12, stop=["\n", "."]) + ".\n"
    forks = s.fork(NUM_POINTS)
    for i in range(NUM_POINTS):
        forks[i] += f"Now I expand tip {i + 1} in one sentence:\nTip {i + 1}:"
        forks[i] += sgl.gen("detail", max_tokens=32, stop="\n")
    forks.join()
    s.set_var("cached_tokens", [branch.get_meta_info("detail")["cached_tokens"] for branch in forks])


@sgl.function
def who_is_the_father(s, question, statements):
    s += "USER: Please memorize these statements.\n"
    forks = s.fork(len(statements))
    forks += lambda i: f"Statement {i}: {statements[i]}\n"
    forks.join(mode="concate_and_append")
    s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=16, stop="\n")


@sgl.function
def city_record(s, city):
    s += f"A JSON record describing {city}.\n"
    with s.var_scope("record"):
        s += '{\n  "name": ' + sgl.gen_string(max_tokens=12) + ",\n"
        s += '  "country": ' + sgl.gen(dtype=str, max_tokens=12) + ",\n"
        s += '  "founded": ' + sgl.gen_int(max_tokens=6) + "\n}"


def run(backend) -> None:
    sgl.set_default_backend(backend)
    state = skeleton_of_thought.run(topic="staying focused", temperature=0)
    for i, detail in enumerate(state["detail"], start=1):
        print(f"tip {i}:{state[f'point_{i}']} ->{detail}")
    print(f"prompt tokens each branch found in the radix cache: {state['cached_tokens']}")

    state = who_is_the_father.run(question="Who is the father of Julian?", temperature=0, statements=[
        "Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."])
    print("answer:", state["answer"].strip())

    state = city_record.run(city="Paris", temperature=0)
    print("record:", json.dumps(json.loads(state["record"])))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: launch one with sgl.Runtime)")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    if args.url:
        run(sgl.RuntimeEndpoint(args.url, api_key=args.api_key))
        return
    runtime = sgl.Runtime()  # the embedded SmolLM2-135M-Instruct; any radixserve server argument goes here
    try:
        print(f"server at {runtime.url}")
        run(runtime)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
