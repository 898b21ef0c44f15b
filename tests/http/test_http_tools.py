"""Tool calling over a real server process on the embedded model, through the official `openai` client.

With `tool_choice` "required" or a named function, decoding is constrained by the call grammar, so even this
135M-parameter model returns calls whose arguments validate against their schemas (jsonschema); with "auto"
every answer is prose or such calls; parallel calls end after a bounded number; streaming
accumulates (the SDK's way) to the same call; a two-turn tool conversation reuses the first turn from the
radix cache; bad tool requests are 400s in the OpenAI envelope."""

from __future__ import annotations

import json

import openai
import pytest

from http_fixtures import ServerProcess
from tool_cases import (  # noqa: F401  (client, model: fixtures)
    PROMPTS, TOOLS, call_case, check_auto_answers, check_auto_call_once_started, check_call,
    check_required_and_named_calls, client, model, tool,
)

from radixserve.runtime.http.openai.tool_grammar import MAX_PARALLEL_CALLS

pytestmark = [pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--log-level", "warning")
    yield process
    process.stop()


def test_required_and_named_calls_always_validate(client, model):
    check_required_and_named_calls(client, model)


@pytest.mark.slow
def test_auto_answers_are_prose_or_valid_calls(client, model):
    check_auto_answers(client, model)


@pytest.mark.slow
def test_auto_call_once_started_is_well_formed(client, model):
    check_auto_call_once_started(client, model, "<tool_call>")


@pytest.mark.slow
def test_parallel_calls_end_after_a_bounded_number(client, model):
    get_time = TOOLS[9]
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What time is it in Oslo, Lima and Pune?"}],
        tools=[get_time], tool_choice="required", parallel_tool_calls=True, max_tokens=400, temperature=0.0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice  # not "length": the grammar ends the output
    assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
    for call in choice.message.tool_calls:
        check_call(call, [get_time])


@pytest.mark.slow
def test_streamed_call_accumulates_to_the_same_call(client, model):
    tools, choice, _ = call_case(2)
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_tool_errors_are_400s(client, model):
    def bad(messages=({"role": "user", "content": "hi"},), **kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=list(messages), max_tokens=4, **kwargs)
        assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
        return info.value

    bad_schema = tool("f", "x", {"x": {"type": "no-such-type"}}, [])
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
