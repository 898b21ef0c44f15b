"""Structured output and prompt logprobs through the Engine (real scheduler and detokenizer processes).

What a caller sees: a bad schema, regex or grammar is a ValueError naming the problem before anything is
queued; json_schema may be a dict; a constrained and an unconstrained request share a batch; prompt-token
logprobs come back in meta_info as (logprob, token id, text) from logprob_start_len on, with their top
alternatives, in the first streamed chunk too.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve import Engine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine():
    with Engine(log_level="warning") as engine:
        yield engine


def chat(engine, question: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                     add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])


@pytest.mark.parametrize("params, words", [
    ({"json_schema": "{not json"}, "invalid json_schema: not valid JSON"),
    ({"json_schema": {"type": "integer", "minimum": 3, "maximum": 1}}, "invalid json_schema: .*minimum"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "invalid json_schema"),
    ({"regex": "[0-9"}, "invalid regex: .*"),
    ({"ebnf": "root ::= missing"}, "invalid ebnf: .*missing"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
])
def test_bad_grammars_are_value_errors_before_queueing(engine, params, words):
    with pytest.raises(ValueError, match=words):
        engine.generate(["fine prompt", "Hello"], [{"max_new_tokens": 4}, {"max_new_tokens": 4, **params}])
    info = engine.get_server_info()
    assert info["num_queued_reqs"] == 0 and info["num_running_reqs"] == 0


def test_constrained_and_free_requests_share_a_batch(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    question = chat(engine, "Describe a city as JSON.")
    free = engine.generate(input_ids=question, sampling_params={"max_new_tokens": 10, "temperature": 0.0})
    results = engine.generate(input_ids=[question, question, question], sampling_params=[
        {"max_new_tokens": 60, "temperature": 0.0, "json_schema": schema},
        {"max_new_tokens": 10, "temperature": 0.0},
        {"max_new_tokens": 12, "temperature": 0.0, "regex": r"[0-9]{3}-[0-9]{4}"},
    ])
    assert results[0]["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(results[0]["text"]), schema)
    assert results[1]["output_ids"] == free["output_ids"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", results[2]["text"])
    streamed = list(engine.generate(
        input_ids=question, sampling_params={"max_new_tokens": 60, "temperature": 0.0, "json_schema": schema},
        stream=True))[-1]["text"]  # each chunk holds the whole text so far
    assert streamed == results[0]["text"]


def test_prompt_logprobs_in_meta_info(engine):
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = engine.tokenizer.encode(prompt)
    result = engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0.0}, return_logprob=True,
                             logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = result["meta_info"]
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [token_id for _, token_id, _ in entries] == ids and len(tops) == len(ids)
    assert entries[0][0] is None and tops[0] is None
    assert all(logprob <= 0.0 for logprob, _, _ in entries[1:])
    assert [text for _, _, text in entries] == [engine.tokenizer.decode([t]) for t in ids]
    for (logprob, token_id, _), alternatives in zip(entries[1:], tops[1:]):
        assert len(alternatives) == 2 and alternatives[0][0] >= alternatives[1][0]
        assert alternatives[0][0] >= logprob - 1e-5
        assert all(text == engine.tokenizer.decode([tid]) for _, tid, text in alternatives)

    # From position 5, scoring only (max_new_tokens=0), without texts: the same values.
    tail = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=5)
    tail_entries = tail["meta_info"]["input_token_logprobs"]
    assert [token_id for _, token_id, _ in tail_entries] == ids[5:]
    assert all(text is None for _, _, text in tail_entries)
    assert [lp for lp, _, _ in tail_entries] == pytest.approx([lp for lp, _, _ in entries[5:]], abs=2e-4)
    assert tail["meta_info"]["cached_tokens"] == 4  # the prompt was cached; positions >= 4 recomputed

    chunks = list(engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0.0},
                                  return_logprob=True, logprob_start_len=1, stream=True))
    first_with_tokens = next(chunk for chunk in chunks if chunk["output_ids"])
    streamed_entries = first_with_tokens["meta_info"]["input_token_logprobs"]
    assert [lp for lp, _, _ in streamed_entries] == pytest.approx([lp for lp, _, _ in entries[1:]], abs=2e-4)
