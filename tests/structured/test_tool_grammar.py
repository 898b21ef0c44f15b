"""The call grammar (tool_grammar.py, python_call_grammar.py) checked with xgrammar's own matcher: for every
parser it accepts exactly well-formed calls of the given tools (calls the parser reads back), one or a bounded
number of them; with "auto" it also accepts free text that the parser leaves as content, and nothing in between;
the pythonic grammar enforces the JSON schema's types, bounds, enums, lengths and required keys on Python
literals."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from radixserve.runtime.http.openai.protocol_tools import Tool
from radixserve.runtime.http.openai.python_call_grammar import python_calls_grammar
from radixserve.runtime.http.openai.reasoning import get_reasoning_parser
from radixserve.runtime.http.openai.tool_grammar import (
    MAX_PARALLEL_CALLS,
    ToolSchemaError,
    check_tool_schemas,
    tool_call_grammar,
)
from radixserve.runtime.http.openai.tool_parsers import get_tool_parser


def _tool(name: str, parameters: dict | None = None) -> Tool:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return Tool.model_validate({"type": "function", "function": function})


TOOLS = [
    _tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}),
    _tool("count", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["n"]}),
    _tool("ping"),
]
WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
PARSERS = ["hermes", "llama3", "mistral", "pythonic"]
BAD_CALLS = ([("get_weather", {"city": "Paris", "unit": "kelvin"})], [("count", {"n": 10})],
             [("get_weather", {"city": "Paris"})], [("unknown", {})], [("count", {"n": "3"})])


@pytest.mark.parametrize("name", PARSERS)
def test_required_grammar_accepts_exactly_valid_calls(name):
    parser = get_tool_parser(name)
    single = tool_call_grammar(parser, TOOLS, parallel=False)
    parallel = tool_call_grammar(parser, TOOLS, parallel=True)
    good = parser.format_calls([WEATHER])
    assert grammar_accepts(single, good) and grammar_accepts(parallel, good)
    two = parser.format_calls([("count", {"n": 3}), ("ping", {})])
    assert grammar_accepts(parallel, two) and not grammar_accepts(single, two)
    for bad in BAD_CALLS:
        assert not grammar_accepts(parallel, parser.format_calls(bad)), bad
    assert not grammar_accepts(parallel, "Sure! " + good) and not grammar_accepts(parallel, "")
    named = tool_call_grammar(parser, TOOLS[1:2], parallel=False)
    assert grammar_accepts(named, parser.format_calls([("count", {"n": 9})]))
    assert not grammar_accepts(named, good)


@pytest.mark.parametrize("name", PARSERS)
def test_parallel_calls_are_bounded(name):
    parser = get_tool_parser(name)
    grammar = tool_call_grammar(parser, TOOLS, parallel=True)
    assert grammar_accepts(grammar, parser.format_calls([("ping", {})] * MAX_PARALLEL_CALLS))
    assert not grammar_accepts(grammar, parser.format_calls([("ping", {})] * (MAX_PARALLEL_CALLS + 1)))


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("parallel", [False, True])
def test_auto_grammar_is_free_text_or_valid_calls(name, parallel):
    parser = get_tool_parser(name)
    grammar = tool_call_grammar(parser, TOOLS, parallel=parallel, auto=True)
    good, two = parser.format_calls([WEATHER]), parser.format_calls([WEATHER, ("ping", {})])
    for text in ("The weather is fine.", "", "Hello\n\nworld", good):
        assert grammar_accepts(grammar, text), text
        parsed = parser.parse(text)
        assert parsed.calls or parsed.content == text  # what the grammar allows is calls or plain content
    assert grammar_accepts(grammar, two) == parallel
    for bad in BAD_CALLS:
        assert not grammar_accepts(grammar, parser.format_calls(bad)), bad
    assert not grammar_accepts(grammar, good + " and then some text")  # the output ends after its calls
    assert not grammar_accepts(grammar, parser.start_marker + " not a call")
    if parser.at_start_only:  # a call is the whole output: prose cannot start like one
        assert not grammar_accepts(grammar, "  " + good)
    else:  # prose may come first, but cannot hold the marker other than in a call
        assert grammar_accepts(grammar, "Let me check.\n" + good)
        parsed = parser.parse("Let me check.\n" + good)
        assert parsed.content.strip() == "Let me check." and len(parsed.calls) == 1
        assert not grammar_accepts(grammar, f"I would write {parser.start_marker} here.")


def test_auto_grammar_lets_a_reasoning_model_think_before_a_call_only_format():
    parser = get_tool_parser("pythonic")
    grammar = tool_call_grammar(parser, TOOLS, parallel=False, auto=True, reasoning=get_reasoning_parser("qwen3"))
    assert grammar_accepts(grammar, "<think>Paris, so get_weather.</think>\n\n" + parser.format_calls([WEATHER]))
    assert grammar_accepts(grammar, "<think>just chat</think>\nHello!")
    assert not grammar_accepts(grammar, "<think>x</think>\n" + parser.format_calls([("count", {"n": 0})]))
    plain = tool_call_grammar(parser, TOOLS, parallel=False, auto=True)
    assert not grammar_accepts(plain, "<think>x</think>\n" + parser.format_calls([WEATHER]))


def test_grammar_survives_a_property_named_root():
    tool = _tool("root", {"type": "object", "properties": {"root": {"type": "string", "const": "root ::= x"}},
                          "required": ["root"]})
    for name in PARSERS:
        parser = get_tool_parser(name)
        grammar = tool_call_grammar(parser, [tool], parallel=True, auto=True)
        assert grammar_accepts(grammar, parser.format_calls([("root", {"root": "root ::= x"})])), name
        xgrammar.Grammar.from_ebnf(grammar)


def test_bad_schemas_are_named():
    with pytest.raises(ToolSchemaError, match=r"tools\[0\]"):
        check_tool_schemas([_tool("f", {"type": "object", "properties": {"x": {"type": "no-such-type"}}})])
    with pytest.raises(ToolSchemaError, match="object"):
        check_tool_schemas([_tool("f", {"type": "string"})])
    pythonic = get_tool_parser("pythonic")
    for tool, message in [(_tool("f", {"type": "object", "properties": {"not-an-identifier": {}}}), "keyword"),
                          (_tool("a.b"), "name of a function"),
                          (_tool("f", {"type": "object", "properties": {"x": {"allOf": [{}]}}}), "allOf"),
                          (_tool("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/y"}}}),
                           "no definition")]:
        with pytest.raises(ToolSchemaError, match=message):
            tool_call_grammar(pythonic, [TOOLS[0], tool], parallel=False, where=["tools[0]", "tools[1]"])


PYTHON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 2, "maxLength": 5},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "note": {"type": "string"}},
                 "required": ["day"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "flag": {"type": "boolean"},
        "maybe": {"type": ["integer", "null"]},
        "node": {"$ref": "#/$defs/node"},
        "extra": {"type": "object"},
    },
    "required": ["title", "when", "tags"],
    "$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                           {"type": "null"}]}},
                       "required": ["next"]}},
}
VALID_ARGUMENTS = [
    'title="abc", when={"day": 3}, tags=["a"]',
    "title='ab', when={'day': 31, 'note': 'x \\'q\\''}, tags=[3, 'b'], ratio=0.5, flag=True, maybe=None",
    'title="abcde", when={"day": 1}, tags=["b"], maybe=-4, node={"next": {"next": None}}, extra={"k": [1, "x"]}',
    'title="a\\nb", when={"day": 9}, tags=["a"], ratio=1, flag=False, node={"next": None}, extra={}',
]
INVALID_ARGUMENTS = [
    'title="a", when={"day": 3}, tags=["a"]',  # minLength
    'title="abcdef", when={"day": 3}, tags=["a"]',  # maxLength
    'title="abc", when={"day": 32}, tags=["a"]',  # maximum
    'title="abc", when={"day": 3}, tags=[]',  # minItems
    'title="abc", when={"day": 3}, tags=["a", "b", "a"]',  # maxItems
    'title="abc", when={"day": 3}, tags=["c"]',  # enum
    'title="abc", when={"day": 3}, tags=["a"], ratio=0',  # exclusiveMinimum
    'title="abc", when={"day": 3}, tags=["a"], flag=true',  # JSON spelling
    'title="abc", tags=["a"]',  # required
    'when={"day": 3}, title="abc", tags=["a"]',  # order
    'title="abc", when={"day": 3, "hour": 2}, tags=["a"]',  # additional property
    'title="abc", when={"day": 3}, tags=["a"], other=1',  # undeclared keyword
    'title="abc", when={"day": 3}, tags=["a"], maybe=1.5',  # integer
    'title="abc", when={"day": 3}, tags=["a"], node={}',  # required in a $ref
    'title="abc", when={"day": 3}, tags=["a"],',  # trailing comma
]


def test_pythonic_grammar_enforces_the_schema_on_python_literals():
    grammar = python_calls_grammar([("plan", PYTHON_SCHEMA), ("ping", {"type": "object", "properties": {}})])
    parser = get_tool_parser("pythonic")
    for arguments in VALID_ARGUMENTS:
        text = f"plan({arguments})"
        assert grammar_accepts(grammar, text), text
        (call,) = parser.parse(f"[{text}]").calls  # the parser reads what the grammar allows
        jsonschema.validate(json.loads(call.arguments), PYTHON_SCHEMA)
    for arguments in INVALID_ARGUMENTS:
        assert not grammar_accepts(grammar, f"plan({arguments})"), arguments
    assert grammar_accepts(grammar, "ping()") and not grammar_accepts(grammar, "ping(x=1)")


def test_written_pythonic_calls_fit_the_grammar():
    parser = get_tool_parser("pythonic")
    grammar = tool_call_grammar(parser, [_tool("plan", PYTHON_SCHEMA)], parallel=True)
    arguments = {"title": "it's", "when": {"day": 2, "note": 'say "hi"'}, "tags": ["a", 3], "ratio": 0.25,
                 "flag": True, "maybe": None, "node": {"next": None}}
    jsonschema.validate(arguments, PYTHON_SCHEMA)
    assert grammar_accepts(grammar, parser.format_calls([("plan", arguments)] * 2))
