"""Tool calling over a real server process on the embedded model, through the official `openai` client.

With `tool_choice` "required" or a named function, decoding is constrained by the call grammar, so even this
135M-parameter model returns calls whose arguments validate against their schemas (jsonschema); streaming
accumulates (the SDK's way) to the same call; a two-turn tool conversation reuses the first turn from the
radix cache; bad tool requests are 400s in the OpenAI envelope."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from http_fixtures import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", "Current weather of a city",
          {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
          ["city", "unit"]),
    _tool("create_event", "Put an event in the calendar", {
        "title": {"type": "string", "maxLength": 30},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                 "required": ["day", "hour"], "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
          ["title", "when", "attendees"]),
    _tool("set_thermostat", "Set the temperature", {"celsius": {"type": "number", "minimum": 10, "maximum": 30}},
          ["celsius"]),
    _tool("order_pizza", "Order a pizza", {
        "size": {"enum": ["small", "medium", "large"]},
        "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "mushroom", "olive"]},
                     "minItems": 1, "maxItems": 3}}, ["size", "toppings"]),
    _tool("toggle_light", "Switch a light", {"room": {"enum": ["kitchen", "bedroom", "hall"]}, "on": {"type": "boolean"}},
          ["room", "on"]),
    _tool("roll_dice", "Roll dice", {"sides": {"type": "integer", "minimum": 2, "maximum": 20},
                                     "count": {"type": "integer", "minimum": 1, "maximum": 5}}, ["sides", "count"]),
    _tool("search_web", "Search the web", {"query": {"type": "string", "maxLength": 40},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    _tool("convert_currency", "Convert money", {"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
                                                "source": {"enum": ["USD", "EUR", "JPY"]},
                                                "target": {"enum": ["USD", "EUR", "JPY"]}},
          ["amount", "source", "target"]),
    _tool("send_email", "Send an email", {"to": {"type": "string", "maxLength": 40},
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


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--log-level", "warning")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1500.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _case(i: int) -> tuple[list[dict], object, str]:
    """Request i of 20: its tools (the target and a distractor), its tool_choice, and the expected name."""
    target, other = TOOLS[i % 10], TOOLS[(i + 3) % 10]
    name = target["function"]["name"]
    choice = {"type": "function", "function": {"name": name}} if i % 2 == 0 else "required"
    return ([target, other] if i % 2 == 0 else [target]), choice, name


def _check_call(call, tools: list[dict]) -> None:
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in tools}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_calls_always_validate(client, model):
    def ask(i: int):
        tools, choice, name = _case(i)
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % 10]}], tools=tools, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=160, temperature=0.0 if i < 10 else 0.8, seed=i)
        return i, response

    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(ask, range(20)))
    for i, response in results:
        tools, choice, name = _case(i)
        choice_out = response.choices[0]
        assert choice_out.finish_reason == "tool_calls", (i, choice_out)
        assert choice_out.message.content is None and len(choice_out.message.tool_calls) == 1, (i, choice_out)
        call = choice_out.message.tool_calls[0]
        _check_call(call, tools)
        if not isinstance(choice, str):
            assert call.function.name == name


def test_streamed_call_accumulates_to_the_same_call(client, model):
    tools, choice, _ = _case(2)
    request = dict(model=model, messages=[{"role": "user", "content": PROMPTS[2]}], tools=tools, tool_choice=choice,
                   max_tokens=120, temperature=0.0)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    names, arguments, ids, finishes = {}, {}, {}, []
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice_delta in chunk.choices:
            finishes += [choice_delta.finish_reason] if choice_delta.finish_reason else []
            assert not choice_delta.delta.content
            for call in choice_delta.delta.tool_calls or []:
                if call.id:
                    ids[call.index], names[call.index] = call.id, call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert finishes == ["tool_calls"]
    assert list(names.values()) == [whole.function.name]
    assert json.loads(arguments[0]) == json.loads(whole.function.arguments)


def test_two_turn_tool_conversation_reuses_the_first_turn(client, model):
    tools = [TOOLS[0]]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    first = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=30,
                                            temperature=0.0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_tool_errors_are_400s(client, model):
    def bad(messages=({"role": "user", "content": "hi"},), **kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=list(messages), max_tokens=4, **kwargs)
        assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
        return info.value

    bad_schema = _tool("f", "x", {"x": {"type": "no-such-type"}}, [])
    assert bad(tools=[bad_schema], tool_choice="required").param == "tools"
    assert bad(tools=[TOOLS[0]], tool_choice={"type": "function", "function": {"name": "nope"}}).param == "tool_choice"
    assert bad(tools=[TOOLS[0]], tool_choice="required", response_format={"type": "json_object"}).param == \
        "tool_choice"
    assert bad(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}],
        tools=[TOOLS[0]]).param == "messages[0].tool_calls"
    # tool_choice none: the tools are not offered, and nothing is parsed.
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                            tools=[TOOLS[0]], tool_choice="none", max_tokens=8, temperature=0.0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
