"""The HTTP layer's pieces that need no running engine: request validation and its 400 envelope, the
conversion of OpenAI fields into engine sampling parameters (checked by the TokenizerManager's own
validator), context budgets, accumulation of streamed chunks, tenancy, admission and token bytes."""

from __future__ import annotations

import json

import pytest

from radixserve.runtime.http.state import InflightRequests, ServerState
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.openai.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from radixserve.runtime.http.openai.serving_common import (
    ChoiceOutput,
    choice_params,
    openai_finish_reason,
    sampling_params,
    usage,
)
from radixserve.runtime.tenancy import AuthenticationError, TenantResolver
from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.sampling_params import SamplingParams
from radixserve.runtime.wire.server_args import ServerArgs

VOCAB = 1000


MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def _state(context_len: int = 100, max_total_tokens: int | None = None) -> ServerState:
    model_info = ModelInfo(context_len=context_len, vocab_size=VOCAB, max_total_num_tokens=max_total_tokens or 1000,
                           max_running_requests=8, page_size=1, eos_token_ids=[0], model_path=None, device="cpu",
                           dtype="float32", attention_backend="torch_native", chunked_prefill_size=None,
                           schedule_policy="fcfs", overlap_schedule=False, radix_cache=True,
                           sampling_defaults=MODEL_DEFAULTS)
    return ServerState(engine=None, server_args=ServerArgs(), tenants=TenantResolver(), inflight=InflightRequests(None),
                       tokenizer=None, served_model_name="m", model_info=model_info, context_len=context_len,
                       vocab_size=VOCAB, max_total_tokens=max_total_tokens)


def _error(model, body) -> APIError:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    with pytest.raises(APIError) as info:
        parse_request(model, raw.encode() if isinstance(raw, str) else raw)
    assert info.value.status_code == 400
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_accepts_what_the_openai_client_sends():
    body = {
        **CHAT, "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c", "refusal": None, "tool_calls": None},
        ],
        "temperature": 0, "top_p": 1, "n": 2, "stop": ["x"], "max_completion_tokens": 5, "seed": -3,
        "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
        "user": "u", "logit_bias": {"17": -100}, "cache_salt": "s", "top_k": 5, "min_p": 0.1, "ignore_eos": True,
    }
    req = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert req.max_new_tokens == 5 and req.include_usage and req.messages[1].text() == "a\nb"


@pytest.mark.parametrize("field,value,param", [
    ("foo", 1, "foo"), ("functions", [], "functions"), ("best_of", 2, "best_of"),
])
def test_unknown_top_level_fields_are_rejected_like_openai(field, value, param):
    error = _error(ChatCompletionRequest, {**CHAT, field: value})
    assert error.param == param and error.message == f"Unrecognized request argument supplied: {param}"
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("patch,param", [
    ({"temperature": "1"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a", ""]}, "stop[1]"),
    ({"stop": 5}, "stop"),
    ({"seed": 2**70}, "seed"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1000}}, "logit_bias.1"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),  # no tool_call_id
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),  # any other role reaches the template
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_invalid_values_name_the_parameter(patch, param):
    assert _error(ChatCompletionRequest, {**CHAT, **patch}).param == param


@pytest.mark.parametrize("raw,message", [
    (b"", "not valid JSON"),
    (b"{", "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', ""),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
])
def test_malformed_bodies_are_400(raw, message):
    assert message in _error(ChatCompletionRequest, raw).message


def test_cross_field_rules():
    no_stream = {**CHAT, "stream_options": {"include_usage": True}}
    assert "stream_options" in _error(ChatCompletionRequest, no_stream).message
    assert "top_logprobs" in _error(ChatCompletionRequest, {**CHAT, "top_logprobs": 2}).message
    assert "best_of" in _error(CompletionRequest, {"prompt": "x", "n": 1, "best_of": 3}).message
    assert _error(CompletionRequest, {"prompt": "x", "suffix": "y"}).param == "suffix"
    assert _error(CompletionRequest, {"prompt": []}).param == "prompt"
    assert _error(CompletionRequest, {"prompt": [[1], []]}).param == "prompt[1]"
    assert _error(CompletionRequest, {"prompt": [-1]}).param == "prompt[0]"


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert parse_request(CompletionRequest, json.dumps({"prompt": prompt}).encode()).prompts() == expected


def test_openai_fields_become_checked_sampling_params():
    body = parse_request(ChatCompletionRequest, json.dumps({
        **CHAT, "temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7,
        "stop": "END", "logit_bias": {"12": 5.5}, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [3], "skip_special_tokens": False,
    }).encode())
    checked = sampling_params(_state(), body, max_new_tokens=10)
    assert (checked.max_new_tokens, checked.min_new_tokens, checked.temperature, checked.top_p) == (10, 2, 0.7, 0.9)
    assert (checked.top_k, checked.min_p, checked.repetition_penalty) == (40, 0.05, 1.1)
    assert (checked.presence_penalty, checked.frequency_penalty, checked.seed) == (0.5, -0.5, 7)
    assert checked.stop == ["END"] and checked.stop_token_ids == [3] and checked.logit_bias == {12: 5.5}
    assert checked.ignore_eos and not checked.skip_special_tokens
    # top_p = 0 keeps only the most likely token: greedy.
    def chat(**fields) -> ChatCompletionRequest:
        return parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())

    assert sampling_params(_state(), chat(top_p=0), 4).is_greedy()
    assert sampling_params(_state(), chat(), None).max_new_tokens is None  # resolved by the length rule
    # Unset sampling values take the model's defaults; set ones (even to the neutral value) stay.
    unset = sampling_params(_state(), chat(), 4)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, -1)
    given = sampling_params(_state(), chat(temperature=1.0, top_p=1.0), 4)
    assert (given.temperature, given.top_p) == (1.0, 1.0)
    assert sampling_params(_state(), chat(stop_token_ids=[3, VOCAB]), 4).stop_token_ids == [3]  # OOV: ignored
    assert sampling_params(_state(), chat(top_k=0), 4).top_k == -1  # vLLM's 0 is no limit, as -1
    for fields, param in (({"logit_bias": {"5000": 1}}, "logit_bias"), ({"min_tokens": 9}, "min_tokens"),
                          ({"regex": "([a-z"}, "regex")):
        with pytest.raises(APIError) as info:
            sampling_params(_state(), chat(**fields), 4)
        assert info.value.status_code == 400 and info.value.param == param, (fields, info.value.param)


def test_seeded_choices_differ_and_stay_in_int64():
    params = SamplingParams(seed=2**63 - 1, temperature=1.0)
    assert choice_params(params, 0) is params
    assert choice_params(params, 1).seed == -(2**63)
    assert choice_params(SamplingParams(), 3) == SamplingParams()


def test_choice_output_accepts_per_chunk_and_cumulative_logprobs():
    per_chunk, cumulative = ChoiceOutput(), ChoiceOutput()
    chunks = [([5, 6], [(-0.1, 5, None), (-0.2, 6, None)]), ([7], [(-0.3, 7, None)])]
    seen: list = []
    for ids, lps in chunks:
        seen += lps
        d1 = per_chunk.add({"text": "x", "output_ids": ids, "meta_info": {"output_token_logprobs": lps}})
        d2 = cumulative.add({"text": "x", "output_ids": ids, "meta_info": {"output_token_logprobs": list(seen)}})
        assert d1.token_logprobs == d2.token_logprobs == lps
    final_meta = {"finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4, "completion_tokens": 3,
                  "cached_tokens": 1}
    final = {"text": "", "output_ids": [], "meta_info": final_meta}
    assert per_chunk.add(final).finish_reason == {"type": "stop", "matched": 2}
    assert per_chunk.text == "xx" and per_chunk.output_ids == [5, 6, 7] and len(per_chunk.token_logprobs) == 3
    assert usage([[per_chunk, per_chunk]]) == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                                               "prompt_tokens_details": {"cached_tokens": 1}}
    assert openai_finish_reason({"type": "length", "length": 3}) == ("length", None)
    assert openai_finish_reason({"type": "abort", "message": "x"}) == ("abort", None)
    assert openai_finish_reason(None) == (None, None)


def test_tenants(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"key-a": "alpha", "key-b": "beta"}))
    resolver = TenantResolver.from_server_args(None, str(path))
    assert resolver.auth_required
    assert resolver.tenant_for("Bearer key-a") == "alpha" and resolver.tenant_for("bearer  key-b ") == "beta"
    for header, code in ((None, "missing_api_key"), ("key-a", "missing_api_key"), ("Bearer key-c", "invalid_api_key"),
                         ("Bearer ", "missing_api_key")):
        with pytest.raises(AuthenticationError) as info:
            resolver.tenant_for(header)
        assert info.value.code == code
    single = TenantResolver.from_server_args("secret", None)
    assert single.tenant_for("Bearer secret") is None
    assert TenantResolver.from_server_args(None, None).tenant_for(None) is None
    for content in ("[]", "{}", json.dumps({"k": ""}), json.dumps({"k": 3}), json.dumps({"k": "a/b"})):
        path.write_text(content)
        with pytest.raises(ValueError):
            TenantResolver.from_server_args(None, str(path))


def test_admission_capacity_ownership_and_drain():
    inflight = InflightRequests(capacity=4)
    inflight.admit({"a": ["a-0", "a-1", "a-2"]}, tenant="t1")
    with pytest.raises(APIError) as info:
        inflight.admit({"b": ["b-0", "b-1"]}, tenant="t2")
    assert info.value.status_code == 503 and info.value.headers["Retry-After"]
    with pytest.raises(APIError) as info:
        inflight.admit({"big": [str(i) for i in range(5)]}, tenant=None)
    assert info.value.status_code == 400
    with pytest.raises(APIError) as info:
        inflight.admit({"a": ["x"]}, tenant="t1")
    assert info.value.status_code == 400
    assert inflight.engine_rids_owned("a", "t1") == ["a-0", "a-1", "a-2"]
    assert inflight.engine_rids_owned("a", "t2") is None and inflight.engine_rids_owned("zz", "t1") is None
    inflight.admit({"c": ["c"]}, tenant=None)
    assert inflight.num_engine_requests == 4 and inflight.num_engine_requests_of("t1") == 3
    assert sorted(inflight.all_engine_rids(), key=str) == [("t1", "a-0"), ("t1", "a-1"), ("t1", "a-2"), (None, "c")]
    inflight.release(["a"], "t1")
    inflight.release(["c"], None)
    assert inflight.num_engine_requests == 0 and len(inflight) == 0
    # Handles are per tenant: two tenants may use the same id.
    inflight.admit({"same": ["same"]}, tenant="t1")
    inflight.admit({"same": ["same"]}, tenant="t2")
    inflight.release(["same"], "t1")
    inflight.release(["same"], "t2")
    per_request = InflightRequests(capacity=None, max_per_request=8)
    with pytest.raises(APIError) as info:
        per_request.admit({"many": [str(i) for i in range(9)]}, tenant=None)
    assert info.value.status_code == 400 and "--max-sequences-per-request" in info.value.message
    inflight.draining = True
    with pytest.raises(APIError) as info:
        inflight.admit({"d": ["d"]}, tenant=None)
    assert info.value.status_code == 503


@pytest.fixture(scope="module")
def token_texts(default_model_dir):
    from radixserve.runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    return tokenizer, TokenTexts(tokenizer)


def test_token_bytes_reassemble_the_text(token_texts):
    tokenizer, texts = token_texts
    for text in ("Hello world", " héllo\n\tthere", "日本語のテキスト 🙂", "<|im_end|>"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(texts.token_bytes(t) for t in ids) == text.encode("utf-8")
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    entries = [(-0.5, t, None) for t in ids]
    content = chat_logprobs(texts, entries, [[(-0.5, t, None), (-1.0, 0, None)] for t in ids], num_top=1)["content"]
    assert bytes(b for c in content for b in c["bytes"]) == "🙂".encode("utf-8")
    assert all(len(c["top_logprobs"]) == 1 for c in content)
    legacy = completion_logprobs(texts, [(None, ids[0])] + entries[1:], [None] + [[(-0.5, t)] for t in ids[1:]], 1, 3)
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None and legacy["text_offset"][0] == 3
