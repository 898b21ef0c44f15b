"""Tool-call and reasoning parsers on hand-written outputs in each model family's real format (malformed ones
included, which must stay in `content`), and their streaming splits (the call grammar: test_tool_grammar.py)."""

from __future__ import annotations

import json

import pytest

from radixserve.runtime.http.openai.chat_stream import ChoiceStream
from radixserve.runtime.http.openai.reasoning import get_reasoning_parser
from radixserve.runtime.http.openai.tool_calling import ChatOutputPlan, split_output
from radixserve.runtime.http.openai.tool_parsers import PARSERS, get_tool_parser
from radixserve.runtime.wire.server_args import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerArgs


def calls_of(parsed):
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "UTC", "precise": True, "offset": None})

RECORDED = [
    # (parser, model text, expected content, expected calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [WEATHER]),
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "precise": true, '
     '"offset": null}}\n</tool_call>', "Let me check.\n", [WEATHER, TIME]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": '
     '\\"celsius\\"}"}\n</tool_call>', "", [WEATHER]),  # arguments as JSON text
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),  # cut off
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', None, []),  # no name
    ("hermes", "The weather is fine.", None, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC", "precise": true, "offset": null}}', "", [WEATHER, TIME]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some prose', None, []),
    ("llama3", 'I think {"name": "get_weather"} is it', None, []),  # not at the start: prose
    ("llama3", '{"name": "get_weather", "parameters": [1, 2]}', None, []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC", "precise": true, "offset": null}}]', "", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"', None, []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, "oops"]', None, []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC", precise=True, offset=None)]',
     "", [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_time(zone="UTC", precise=true, offset=null)]<|python_end|>', "", [TIME]),
    ("pythonic", '[get_weather("Paris")]', None, []),  # positional arguments are not a call
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]', None, []),  # never evaluated
    ("pythonic", '[get_weather(city="Par', None, []),
    ("pythonic", "[1, 2, 3]", None, []),
]


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_recorded_outputs(name, text, content, calls):
    parsed = get_tool_parser(name).parse(text)
    assert calls_of(parsed) == calls
    assert parsed.content == (text if content is None else content)  # malformed: the text stays as it was
    assert len({call.id for call in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_written_calls_parse_back(name):
    parser = get_tool_parser(name)
    calls = [WEATHER, ("nested", {"a": {"b": [1, 2.5, "x"]}, "flag": False})]
    assert calls_of(parser.parse(parser.format_calls(calls))) == calls


def test_flag_names_match_the_registries():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek-r1"}
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerArgs(reasoning_parser="nope")


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4", "\nThe user wants 2+2.\n", "4"),
    ("qwen3", "4", "", "4"),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("deepseek-r1", "The user wants 2+2.\n</think>\n\n4", "The user wants 2+2.\n", "4"),
    ("deepseek-r1", "<think>x</think>y", "x", "y"),
    ("deepseek-r1", "never closed", "never closed", ""),
])
def test_reasoning_split(name, text, reasoning, content):
    split = get_reasoning_parser(name).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def _plan(tool_parser=None, reasoning_parser=None):
    return ChatOutputPlan(get_tool_parser(tool_parser) if tool_parser else None,
                          get_reasoning_parser(reasoning_parser) if reasoning_parser else None, {}, [], None)


def _stream(plan, pieces):
    stream = ChoiceStream(plan)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, finished=i == len(pieces) - 1)
    return deltas


def _accumulate(deltas):
    """What the openai SDK's stream helpers build from the deltas."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in call:
                assert entry["id"] is None and call["function"]["arguments"] == ""  # name first, once
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            else:
                assert entry["id"] is not None
                entry["arguments"] += call["function"]["arguments"]
    return content, reasoning, [calls[i] for i in sorted(calls)]


# Outputs whose call head (`{"name": ..., "arguments": {`) went out before the text stopped being a well-formed
# call: the stream has sent that call (name, arguments so far) and cannot take it back, so it ends as that call,
# with the content before it. (name, text) -> the calls as streamed (name, arguments text).
STREAMED_BEFORE_SPOILED = {
    ("hermes", RECORDED[3][1]): [("get_weather", '{"city": "Par')],
    ("llama3", RECORDED[8][1]): [("get_weather", '{"city": "Paris"}')],
    ("mistral", RECORDED[12][1]): [("get_weather", '{"city": "Paris"')],
    ("mistral", RECORDED[13][1]): [("get_weather", "{}")],
}


@pytest.mark.parametrize("name,text,_content,_calls", [r for r in RECORDED if r[0] in ("hermes", "qwen25", "llama3",
                                                                                        "mistral", "pythonic")])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streaming_accumulates_to_the_final_parse(name, text, _content, _calls, piece):
    plan = _plan(name, "qwen3")
    full = f"<think>plan the call</think>\n{text}"
    pieces = [full[i:i + piece] for i in range(0, len(full), piece)]
    content, reasoning, calls = _accumulate(_stream(plan, pieces))
    final = split_output(plan, full)
    assert reasoning == final.reasoning_content
    if (name, text) in STREAMED_BEFORE_SPOILED:
        assert content == "" and not final.tool_calls
        assert [(c["name"], c["arguments"]) for c in calls] == STREAMED_BEFORE_SPOILED[name, text]
        return
    assert content == (final.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in final.tool_calls]


def test_a_call_cut_by_max_tokens_streams_its_name_then_its_arguments_as_they_come():
    """The name goes out as a tool-call delta once the call's head is written, each piece of the arguments after
    it, and the raw `<tool_call>` text never as content (SGLang streams such a call the same way)."""
    stream = ChoiceStream(_plan("hermes"))
    pieces = ["Sure.\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Par']
    deltas = [stream.feed(piece, finished=False) for piece in pieces[:-1]] + [stream.feed(pieces[-1], finished=True)]
    assert deltas[0] == [{"content": "Sure.\n"}] and deltas[1] == []
    header, arguments = deltas[2]
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert deltas[3] == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Par'}}]}]
    assert [call.name for call in stream.calls] == ["get_weather"]


def test_streaming_never_shows_a_split_marker_as_content():
    deltas = _stream(_plan("hermes"), ["Sure. <tool", '_call>\n{"name": "f", "arguments": {}}\n</tool_call>'])
    assert [d.get("content") for d in deltas if "content" in d] == ["Sure. "]
    assert _accumulate(deltas)[2][0]["name"] == "f"
