"""Anthropic's Messages API over a real server process on the embedded model, through the official `anthropic` SDK.

A message answers what the chat route answers for the same conversation (greedy); streamed, it accumulates to the
same message; a tool-use round trip (tool_use -> tool_result -> answer) gets a call that validates against its
schema and reads the first turn back from the radix cache; count_tokens counts the prompt a message computes or
reads; stop sequences stop with Anthropic's reason; errors are the SDK's exception classes."""

from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest

from http_fixtures import ServerProcess

from radixserve.runtime.http.anthropic.messages import _Blocks
from radixserve.runtime.http.openai.chat_stream import ChoiceStream
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest
from radixserve.runtime.http.openai.reasoning import get_reasoning_parser
from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan

pytestmark = [pytest.mark.timeout(900)]

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0.0}  # the current SDK takes sampling values through extra_body
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", KEY,
                            "--log-level", "warning", api_key=KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=600.0)


@pytest.fixture(scope="module")
def model(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list().data[0].id


def test_message_answers_as_the_chat_route_does(client, server, model):
    message = client.messages.create(model=model, max_tokens=24, system="Answer briefly.",
                                     messages=[{"role": "user", "content": "Name a fruit."}], extra_body=GREEDY)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).chat.completions.create(
        model=model, max_tokens=24, temperature=0.0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=model, system="Answer briefly.",
                                           messages=[{"role": "user", "content": "Name a fruit."}])
    assert counted.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_stream_accumulates_to_the_same_message(client, model):
    request = dict(model=model, max_tokens=20, messages=[{"role": "user", "content": "Say hello to Ana."}],
                   extra_body=GREEDY)
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # Every streamed text delta was sent once: SDK's text_stream is exactly the text.
    with client.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


@pytest.mark.slow
def test_tool_use_round_trip(client, model):
    question = {"role": "user", "content": "What's the weather like in Paris today?"}
    first = client.messages.create(model=model, max_tokens=120, tools=[WEATHER], messages=[question],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    calls = [block for block in first.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    with client.messages.stream(model=model, max_tokens=120, tools=[WEATHER], messages=[question],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [block.input for block in streamed.content if block.type == "tool_use"] == [calls[0].input]

    answer = client.messages.create(
        model=model, max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY,
        messages=[question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                "content": "18 degrees and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prompt is still in the radix cache


@pytest.mark.slow
def test_stop_sequence(client, model):
    request = dict(model=model, max_tokens=24, messages=[{"role": "user", "content": "Count from one to ten."}],
                   extra_body=GREEDY)
    text = client.messages.create(**request).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(**request, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and text.startswith(stopped.content[0].text)


@pytest.mark.slow
def test_assistant_prefill_is_continued(client, model):
    prefix = "The capital of France is"
    whole = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Tell me a fact."},
                                             {"role": "assistant", "content": prefix}])
    assert not whole.content[0].text.startswith(prefix)  # the answer goes on from the prefill, it does not repeat it


@pytest.mark.slow
def test_errors_are_the_sdks_exception_classes(client, server, model):
    one = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as error:  # any other name serves the one base model, as SGLang does
        client.messages.create(model=f"{model}:no-such-adapter", max_tokens=4, messages=one)
    assert error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=model, max_tokens=4, messages=one, extra_body={"temperature": 3.0})
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": error.value.body[
        "error"]["message"]}} and "temperature" in error.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # images are not read by the served models
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=4, messages=one, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "not_a_tool"})
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=one)
    assert error.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):  # the stream's errors come before its first event
        with client.messages.stream(model=model, max_tokens=4, messages=one, extra_body={"top_p": 2.0}) as stream:
            list(stream)


@pytest.mark.slow
def test_thinking_and_tool_use_blocks_of_a_stream():
    """The block events of a streamed output with thinking, text and a call (no model needed for the framing)."""
    from radixserve.runtime.http.openai.tool_parsers import get_tool_parser

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    plan = ChatOutputPlan(get_tool_parser("hermes"), get_reasoning_parser("qwen3"), {}, [], body)
    stream, blocks, events = ChoiceStream(plan), _Blocks(), []
    text = '<think>plan it</think>Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for number, piece in enumerate([text[:10], text[10:30], text[30:]]):
        for delta in stream.feed(piece, finished=number == 2):
            events += blocks.events(delta)
    events += blocks.close()
    starts = [event["content_block"]["type"] for event in events if event["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [event["index"] for event in events if event["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [event["delta"] for event in events if event["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "plan it"
    assert "".join(d.get("text", "") for d in deltas) == "Sure."
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"a": 1}'
