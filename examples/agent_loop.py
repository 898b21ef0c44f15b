"""A minimal agent loop over `radixserve serve` with the official OpenAI client: the model calls tools, the loop
runs them and sends the results back, until the model answers in prose (or a turn limit is reached).

    radixserve serve --tool-call-parser hermes     # http://127.0.0.1:30000
    python examples/agent_loop.py "What's the weather in Paris, in celsius?"

The first turn uses tool_choice "required", so the call is constrained by the grammar and always parses; later
turns use "auto" and let the model decide. Each turn's usage shows the conversation prefix served from the cache.
"""

from __future__ import annotations

import argparse
import json

import openai

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]


def get_weather(city: str, unit: str) -> dict:
    return {"city": city, "temperature": 18 if unit == "celsius" else 64, "unit": unit, "sky": "clear"}


def add(a: float, b: float) -> dict:
    return {"sum": a + b}


FUNCTIONS = {"get_weather": get_weather, "add": add}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What's the weather in Paris, in celsius?")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "user", "content": args.question}]
    for turn in range(args.max_turns):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required" if turn == 0 else "auto",
            parallel_tool_calls=False, max_tokens=120, temperature=0.0)
        message = response.choices[0].message
        cached = response.usage.prompt_tokens_details.cached_tokens
        print(f"turn {turn}: {response.usage.prompt_tokens} prompt tokens, {cached} from the cache")
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"answer: {message.content}")
            return
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = FUNCTIONS[call.function.name](**arguments)
            print(f"  {call.function.name}({arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    print("turn limit reached")


if __name__ == "__main__":
    main()
