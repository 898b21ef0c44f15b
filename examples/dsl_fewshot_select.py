"""Few-shot classification with `select`, over a batch of inputs that share the few-shot prefix.

    make serve                                   # or: radixserve serve  (http://127.0.0.1:30000)
    python examples/dsl_fewshot_select.py        # another terminal
    python examples/dsl_fewshot_select.py --url http://host:8000 --api-key sk-...

`select` scores every label as a continuation of the prompt (all labels in one batched request) and picks
the best; `run_batch` prefills the few-shot examples once, so every program finds them in the radix cache.
"""

from __future__ import annotations

import argparse

from radixserve.frontend import RuntimeEndpoint, function, select, set_default_backend

LABELS = ["positive", "negative"]
EXAMPLES = [
    ("I love this phone, the battery lasts for days.", "positive"),
    ("The delivery was late and the box was damaged.", "negative"),
    ("Best concert I have been to in years!", "positive"),
    ("The app crashes every time I open it.", "negative"),
    ("Our guide was friendly and knew every street.", "positive"),
    ("The room smelled of smoke and the sheets were dirty.", "negative"),
]
INPUTS = [
    "The food was cold and the waiter ignored us.",
    "What a fantastic view from the hotel room!",
    "I would not recommend this course to anyone.",
    "My new running shoes are incredibly comfortable.",
    "The battery died after one hour, what a waste of money.",
]


@function
def classify(s, text):
    s += "Classify the sentiment of each sentence as positive or negative.\n\n"
    for example, label in EXAMPLES:
        s += f"Sentence: {example}\nSentiment: {label}\n\n"
    s += "Sentence: " + text + "\nSentiment: " + select("label", LABELS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    set_default_backend(RuntimeEndpoint(args.url, api_key=args.api_key))

    states = classify.run_batch([{"text": text} for text in INPUTS], progress_bar=True)
    for text, state in zip(INPUTS, states):
        scores = state.get_meta_info("label")["scores"]
        detail = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
        print(f"{state['label']:>8}  {text}   (mean token logprob: {detail})")


if __name__ == "__main__":
    main()
