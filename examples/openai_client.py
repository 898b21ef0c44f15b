"""Talk to a running `radixserve serve` with the official OpenAI client.

    make serve                                  # or: radixserve serve  (http://127.0.0.1:30000)
    python examples/openai_client.py            # another terminal
    python examples/openai_client.py --base-url http://host:8000/v1 --api-key sk-...

Shows a chat completion, a streamed one, a completion with logprobs, and prefix caching at work: the
second request with the same long system prompt reports cached prompt tokens.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key (any string when it has none)")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}\n")

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=48,
        temperature=0,
    )
    print("chat:", reply.choices[0].message.content, f"\n  ({reply.usage.completion_tokens} tokens)\n")

    print("streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                           temperature=0, logprobs=2)
    choice = completion.choices[0]
    print("completion:", repr(choice.text))
    for token, logprob in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs):
        print(f"  {token!r:>12} {logprob:8.3f}")
    print()

    system = "You are a terse assistant. " + "Answer in one short sentence. " * 40
    for attempt in (1, 2):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=16,
            temperature=0,
        )
        details = reply.usage.prompt_tokens_details
        cached = details.cached_tokens if details else 0
        print(f"attempt {attempt}: {reply.usage.prompt_tokens} prompt tokens, {cached} served from the cache")


if __name__ == "__main__":
    main()
