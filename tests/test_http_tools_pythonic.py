"""The pythonic tool-call format on a real server process (`--tool-call-parser pythonic`) and the embedded model,
through the official `openai` client: the call grammar writes `[name(key=value, ...)]` with Python literals
constrained by the tools' schemas, so "required" and named calls validate (jsonschema) 20/20, one call when
`parallel_tool_calls` is false; "auto" answers are prose or such calls; a streamed call accumulates to the
same call."""

from __future__ import annotations

import collections
import concurrent.futures
import json

import openai
import pytest

from http_fixtures import ServerProcess
from tool_cases import PROMPTS, auto_answer, call_case, check_call

from radixserve.runtime.model_files import default_model_path, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "pythonic", "--log-level", "warning")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1500.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_required_and_named_pythonic_calls_always_validate(client, model):
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
        check_call(choice_out.message.tool_calls[0], tools)
        if not isinstance(choice, str):
            assert choice_out.message.tool_calls[0].function.name == name


def test_auto_pythonic_answers_are_prose_or_valid_calls(client, model):
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        kinds = collections.Counter(pool.map(lambda i: auto_answer(client, model, i), range(16)))
    print("auto answers:", dict(kinds))
    assert kinds["prose"] > 0  # the grammar leaves the model free to answer in text


def test_auto_call_once_started_is_well_formed(client, model):
    """Pushed towards the call marker (logit_bias on its tokens, at every step), the model starts a call in
    "auto"; the grammar then makes it one complete, schema-valid call, and ends the output after it."""
    tokenizer = load_tokenizer(default_model_path())
    bias = {str(token): 15 for token in tokenizer.encode('[')}
    # one call (parallel_tool_calls false for these i), its strings bounded: 240 tokens always hold it
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        kinds = list(pool.map(lambda i: auto_answer(client, model, i, logit_bias=bias, max_tokens=240),
                              [1, 2, 3, 5, 6, 7, 9, 10]))
    assert kinds == ["calls"] * 8, kinds


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
