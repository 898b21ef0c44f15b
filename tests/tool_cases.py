"""Tools, prompts and checks shared by the HTTP tool-calling tests: ten tools with varied parameter schemas
(nested objects, enums, arrays, bounded numbers, none at all) and a prompt that fits each."""

from __future__ import annotations

import json
from typing import Optional

import jsonschema


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
