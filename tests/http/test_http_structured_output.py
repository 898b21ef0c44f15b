"""Structured output and prompt logprobs on the native /generate route of a real server process.

(The OpenAI routes' response_format / regex / ebnf / echo are in test_http_openai.py.)
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from http_fixtures import shared_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    return shared_server()


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", headers=server.headers(), timeout=120.0, json=body)


def test_native_generate_with_constraints(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response = generate(server, {"text": ["Answer as JSON:", "Pick yes or no:"], "sampling_params": [
        {"max_new_tokens": 20, "temperature": 0, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 5, "temperature": 0, "regex": " ?(yes|no)"}]})
    assert response.status_code == 200, response.text
    as_json, yes_no = response.json()
    assert isinstance(json.loads(as_json["text"])["ok"], bool)
    assert re.fullmatch(" ?(yes|no)", yes_no["text"])


@pytest.mark.parametrize("params, words", [
    ({"json_schema": '{"type": "string", "minLength": 5, "maxLength": 2}'}, "invalid json_schema"),
    ({"regex": "(a"}, "invalid regex"),
    ({"ebnf": "root ::= ("}, "invalid ebnf"),
])
def test_native_generate_rejects_bad_grammars_with_400(server, params, words):
    response = generate(server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **params}})
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]
    server.wait_idle()


def test_native_generate_prompt_logprobs_with_text(server):
    body = {"text": "One, two, three, four", "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1, "return_text_in_logprobs": True}
    meta = generate(server, body).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == meta["prompt_tokens"] - 2
    assert all(lp is not None and lp <= 0 and isinstance(text, str) for lp, _, text in entries)
    assert "".join(text for _, _, text in entries) in "One, two, three, four"
    assert [len(top) for top in meta["input_top_logprobs"]] == [1] * len(entries)
