"""OpenAI's Responses API over a real server process on the embedded model, through the official `openai` SDK.

A response answers what the chat route answers for the same conversation (greedy); `responses.stream` accumulates
to the same response; a `previous_response_id` chain of three turns carries the conversation and its later turns
read the earlier ones from the radix cache; a function-call round trip gets a call valid for its schema;
`retrieve` and `delete` act on the caller's own stored responses only; bad requests are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from http_fixtures import KEY_A, KEY_B, ServerProcess, tenants_file

pytestmark = [pytest.mark.timeout(900)]

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                            "--tenants-file", tenants_file(), "--log-level", "warning", api_key=KEY_A)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=600.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_response_answers_as_the_chat_route_does(client, model):
    response = client.responses.create(model=model, instructions="Answer briefly.", input="Name a fruit.",
                                       max_output_tokens=24, temperature=0.0)
    chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 24


@pytest.mark.slow
def test_stream_accumulates_to_the_same_response(client, model):
    request = dict(model=model, input="Say hello to Ana.", max_output_tokens=200, temperature=0.0)
    whole = client.responses.create(**request)
    assert whole.status == "completed"
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == \
        whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed response is stored too


def test_previous_response_chain_reads_earlier_turns_from_the_cache(client, model):
    questions = ["Name a fruit.", "Name a vegetable.", "Name a color."]
    previous, prompt_tokens = None, []
    for turn, question in enumerate(questions):
        response = client.responses.create(model=model, instructions="Answer in one word.", input=question,
                                           previous_response_id=previous, max_output_tokens=16, temperature=0.0)
        usage = response.usage
        if turn > 0:
            # The earlier turn's prompt (and its answer) is a prefix of this one and still in the radix cache.
            assert usage.input_tokens > prompt_tokens[-1]
            assert usage.input_tokens_details.cached_tokens >= prompt_tokens[-1] - 1, usage
        assert response.previous_response_id == previous
        prompt_tokens.append(usage.input_tokens)
        previous = response.id
    # The chain's last turn saw the whole conversation: the same prompt as a chat request holding it.
    history = [{"role": "system", "content": "Answer in one word."}]
    for response_id, question in zip(_chain(client, previous), questions):
        history += [{"role": "user", "content": question},
                    {"role": "assistant", "content": client.responses.retrieve(response_id).output_text}]
    chat = client.chat.completions.create(model=model, messages=history[:-1], max_tokens=16, temperature=0.0)
    assert chat.usage.prompt_tokens == prompt_tokens[-1]
    assert chat.choices[0].message.content == history[-1]["content"]


def _chain(client, last_id):
    ids = []
    while last_id is not None:
        ids.insert(0, last_id)
        last_id = client.responses.retrieve(last_id).previous_response_id
    return ids


@pytest.mark.slow
def test_function_call_round_trip(client, model):
    call_response = client.responses.create(model=model, input="What's the weather like in Paris today?",
                                            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                            max_output_tokens=120, temperature=0.0)
    calls = [item for item in call_response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", call_response.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(model=model, input="What's the weather like in Paris today?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                                 max_output_tokens=120, temperature=0.0) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    assert [item.arguments for item in streamed.output if item.type == "function_call"] == [deltas]
    assert json.loads(deltas) == json.loads(calls[0].arguments)

    answer = client.responses.create(model=model, previous_response_id=call_response.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "18 degrees and sunny"}],
                                     max_output_tokens=200, temperature=0.0)
    assert answer.status == "completed" and answer.output
    assert answer.usage.input_tokens_details.cached_tokens > 0  # the call turn's prompt is still cached
    # The whole round trip as items, without the store, renders the same prompt.
    replayed = client.responses.create(
        model=model, tools=[WEATHER], store=False, max_output_tokens=200, temperature=0.0,
        input=[{"role": "user", "content": "What's the weather like in Paris today?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}])
    assert replayed.usage.input_tokens == answer.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store false: nothing is kept
        client.responses.retrieve(replayed.id)


@pytest.mark.slow
def test_retrieve_and_delete_are_the_tenants_own(client, server, model):
    response = client.responses.create(model=model, input="Hi", max_output_tokens=4)
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0)
    assert client.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):  # nor continue it
        other.responses.create(model=model, input="Go on", previous_response_id=response.id, max_output_tokens=4)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Go on", previous_response_id=response.id, max_output_tokens=4)


@pytest.mark.slow
def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 20}}, "required": ["fruit"],
              "additionalProperties": False}
    response = client.responses.create(model=model, input="Name a fruit as JSON.", max_output_tokens=60,
                                       temperature=0.0, text={"format": {"type": "json_schema", "name": "fruit",
                                                                         "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.slow
def test_bad_requests_are_400s(client, model):
    bad = [dict(input="x", temperature=3.0), dict(input="x", tools=[{"type": "web_search"}]),
           dict(input="x", background=True), dict(input="x", truncation="auto"),
           dict(input="x", tool_choice="required"), dict(input=[{"type": "image", "url": "x"}]),
           dict(input="x", prompt_cache_retention="24h"), dict(input="x", prompt_cache_retention="1w"),
           dict(input="x", tools=[{"type": "function", "name": "f",  # JSON allows it; a 64-bit integer does not
                                   "parameters": {"type": "object", "maximum": 2 ** 70}}])]
    for fields in bad:
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=model, max_output_tokens=4, **fields)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=f"{model}:no-such-adapter", input="x")  # other names serve the base model
