"""The pythonic tool-call format on a real server process (`--tool-call-parser pythonic`) and the embedded model,
through the official `openai` client: the call grammar writes `[name(key=value, ...)]` with Python literals
constrained by the tools' schemas, so "required" and named calls validate (jsonschema) 20/20, one call when
`parallel_tool_calls` is false; "auto" answers are prose or such calls; a streamed call accumulates to the
same call."""

from __future__ import annotations

import json

import pytest

from http_fixtures import ServerProcess
from tool_cases import (  # noqa: F401  (client, model: fixtures)
    PROMPTS, call_case, check_auto_answers, check_auto_call_once_started, check_required_and_named_calls, client,
    model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "pythonic", "--log-level", "warning")
    yield process
    process.stop()


def test_required_and_named_pythonic_calls_always_validate(client, model):
    check_required_and_named_calls(client, model)


def test_auto_pythonic_answers_are_prose_or_valid_calls(client, model):
    check_auto_answers(client, model)


def test_auto_call_once_started_is_well_formed(client, model):
    check_auto_call_once_started(client, model, "[")


def test_streamed_pythonic_call_accumulates_to_the_same_call(client, model):
    tools, choice, _ = call_case(4)
    request = dict(model=model, messages=[{"role": "user", "content": PROMPTS[4]}], tools=tools, tool_choice=choice,
                   max_tokens=120, temperature=0.0)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    names, arguments = {}, {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for delta in chunk.choices:
            assert not delta.delta.content
            for call in delta.delta.tool_calls or []:
                if call.id:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert list(names.values()) == [whole.function.name]
    assert json.loads(arguments[0]) == json.loads(whole.function.arguments)
