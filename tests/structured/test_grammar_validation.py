"""Early grammar validation (runtime/wire/grammar_check.py) and its use in SamplingParams.from_request: a bad
schema, regex or grammar is a ValueError whose message names the kind and the problem, without xgrammar's
source locations; a good one passes unchanged."""

from __future__ import annotations

import json

import pytest

from radixserve.runtime.wire.grammar_check import check_grammar
from radixserve.runtime.wire.sampling_params import SamplingParams

VOCAB = 1000


@pytest.mark.parametrize("kind, text", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
    ("json_schema", "{}"),
    ("json_schema", json.dumps({"type": "array", "items": {"enum": ["x", 1, None]}, "maxItems": 3})),
    ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
    ("ebnf", 'root ::= "a" rest\nrest ::= [0-9]+'),
])
def test_valid_grammars_pass(kind, text):
    check_grammar(kind, text)
    assert getattr(SamplingParams.from_request({kind: text}, VOCAB), kind) == text


@pytest.mark.parametrize("kind, text, expected", [
    ("json_schema", "{oops", "invalid json_schema: not valid JSON"),
    ("json_schema", json.dumps({"type": "strnig"}), 'invalid json_schema: Unsupported type "strnig"'),
    ("json_schema", json.dumps({"type": "integer", "minimum": 9, "maximum": 1}), "invalid json_schema: Invalid range"),
    ("json_schema", json.dumps([1, 2]), "invalid json_schema: Schema should be an object"),
    ("regex", "(ab", "invalid regex: Regex parsing error"),
    ("ebnf", "root ::= other", 'invalid ebnf: EBNF parser error at line 1, column 10: Rule "other" is not defined'),
])
def test_invalid_grammars_name_the_problem(kind, text, expected):
    with pytest.raises(ValueError) as info:
        check_grammar(kind, text)
    message = str(info.value)
    assert message.startswith(expected) and ".cc:" not in message and "\n" not in message
    with pytest.raises(ValueError, match="^invalid"):
        SamplingParams.from_request({kind: text}, VOCAB)


def test_a_schema_dict_becomes_its_json_text():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    assert json.loads(SamplingParams.from_request({"json_schema": schema}, VOCAB).json_schema) == schema
