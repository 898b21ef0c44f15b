"""Tools, prompts and checks shared by the HTTP tool-calling tests: ten tools with varied parameter schemas
(nested objects, enums, arrays, bounded numbers, none at all) and a prompt that fits each."""

from __future__ import annotations

import collections
import concurrent.futures
import json
from typing import Optional

import jsonschema
import openai
import pytest

from radixserve.runtime.model_files import default_model_path, load_tokenizer


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    tool("get_weather", "Current weather of a city",
         {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
         ["city", "unit"]),
    tool("create_event", "Put an event in the calendar", {
        "title": {"type": "string", "maxLength": 30},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                 "required": ["day", "hour"], "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
         ["title", "when", "attendees"]),
    tool("set_thermostat", "Set the temperature", {"celsius": {"type": "number", "minimum": 10, "maximum": 30}},
         ["celsius"]),
    tool("order_pizza", "Order a pizza", {
        "size": {"enum": ["small", "medium", "large"]},
        "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "mushroom", "olive"]},
                     "minItems": 1, "maxItems": 3}}, ["size", "toppings"]),
    tool("toggle_light", "Switch a light",
         {"room": {"enum": ["kitchen", "bedroom", "hall"]}, "on": {"type": "boolean"}}, ["room", "on"]),
    tool("roll_dice", "Roll dice", {"sides": {"type": "integer", "minimum": 2, "maximum": 20},
                                    "count": {"type": "integer", "minimum": 1, "maximum": 5}}, ["sides", "count"]),
    tool("search_web", "Search the web", {"query": {"type": "string", "maxLength": 40},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    tool("convert_currency", "Convert money", {"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
                                               "source": {"enum": ["USD", "EUR", "JPY"]},
                                               "target": {"enum": ["USD", "EUR", "JPY"]}},
         ["amount", "source", "target"]),
    tool("send_email", "Send an email", {"to": {"type": "string", "maxLength": 40},
                                         "subject": {"type": "string", "maxLength": 40},
                                         "urgent": {"type": "boolean"}}, ["to", "subject", "urgent"]),
    {"type": "function", "function": {"name": "get_time", "description": "The current time"}},
]
PROMPTS = [
    "What's the weather like in Paris today?", "Schedule lunch with Ana and Bo on the 12th at noon.",
    "Make it 21 degrees in here.", "I want a large pizza with ham and olives.", "Turn off the kitchen light.",
    "Roll two six-sided dice.", "Find recipes for banana bread.", "How many yen is 50 dollars?",
    "Email bob@example.com that the meeting moved.", "What time is it?",
]


def call_case(i: int) -> tuple[list[dict], object, str]:
    """Request i of 20: its tools (the target and a distractor), its tool_choice, and the expected name."""
    target, other = TOOLS[i % 10], TOOLS[(i + 3) % 10]
    name = target["function"]["name"]
    choice = {"type": "function", "function": {"name": name}} if i % 2 == 0 else "required"
    return ([target, other] if i % 2 == 0 else [target]), choice, name


def check_call(call, tools: list[dict]) -> None:
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in tools}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


CHAT_PROMPTS = ["Hi! How are you today?", "Tell me a joke about cats.", "What is the capital of Italy?",
                "Thanks, that is all."]
# An earlier turn in which the assistant called a tool: a small model imitates it more readily.
FEW_SHOT = [
    {"role": "user", "content": "What's the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"celsius": 3})},
    {"role": "assistant", "content": "It is 3 degrees in Oslo."},
]


def auto_answer(client, model: str, i: int, logit_bias: Optional[dict[str, int]] = None, max_tokens: int = 100) -> str:
    """Ask request i of a tool_choice "auto" series (a tool prompt, after an earlier call or not, or a chat
    prompt; one call or parallel calls) and check its answer: calls whose arguments validate, or prose that
    holds no call (the parser found none). Returns "calls", "prose" or "cut" (max_tokens ended it: only its
    finished calls are checked)."""
    tools = [TOOLS[i % 10], TOOLS[(i + 5) % 10]]
    prompt = PROMPTS[i % 10] if i % 3 else CHAT_PROMPTS[i // 3 % len(CHAT_PROMPTS)]
    messages = (FEW_SHOT if i % 2 else []) + [{"role": "user", "content": prompt}]
    parallel = i % 4 == 0
    response = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="auto", parallel_tool_calls=parallel,
        max_tokens=max_tokens, temperature=0.9, seed=i, logit_bias=logit_bias)
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    for call in calls:
        check_call(call, tools)
    if choice.finish_reason == "length":
        return "cut"
    if calls:
        assert choice.finish_reason == "tool_calls" and (parallel or len(calls) == 1), (i, choice)
        return "calls"
    assert choice.finish_reason == "stop", (i, choice)
    return "prose"


# ---- the checks both tool-call formats pass over HTTP (tests/test_http_tools*.py) -----------------------------

@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client on the module's `server` fixture."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1500.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def check_required_and_named_calls(client, model: str) -> None:
    """20 requests with tool_choice "required" or a named function (10 greedy, 10 sampled), one call each:
    every call validates against its tool's schema and a named call calls that function."""
    def ask(i: int):
        tools, choice, _ = call_case(i)
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % 10]}], tools=tools, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=160, temperature=0.0 if i < 10 else 0.8, seed=i)

    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(ask, range(20)))
    for i, response in enumerate(responses):
        tools, choice, name = call_case(i)
        choice_out = response.choices[0]
        assert choice_out.finish_reason == "tool_calls", (i, choice_out)
        assert choice_out.message.content is None and len(choice_out.message.tool_calls) == 1, (i, choice_out)
        call = choice_out.message.tool_calls[0]
        check_call(call, tools)
        if not isinstance(choice, str):
            assert call.function.name == name


def check_auto_answers(client, model: str) -> None:
    """16 "auto" requests: each answer is prose or valid calls, and some are prose."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        kinds = collections.Counter(pool.map(lambda i: auto_answer(client, model, i), range(16)))
    print("auto answers:", dict(kinds))
    assert kinds["prose"] > 0  # the grammar leaves the model free to answer in text


def check_auto_call_once_started(client, model: str, marker: str) -> None:
    """Pushed towards the call `marker` (logit_bias on its tokens, at every step), the model starts a call in
    "auto"; the grammar then makes it one complete, schema-valid call, and ends the output after it."""
    tokenizer = load_tokenizer(default_model_path())
    bias = {str(token): 15 for token in tokenizer.encode(marker)}
    # one call (parallel_tool_calls false for these i), its strings bounded: 240 tokens always hold it
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        kinds = list(pool.map(lambda i: auto_answer(client, model, i, logit_bias=bias, max_tokens=240),
                              [1, 2, 3, 5, 6, 7, 9, 10]))
    assert kinds == ["calls"] * 8, kinds
