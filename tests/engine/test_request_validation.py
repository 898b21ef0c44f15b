"""GenerateReqInput splitting, cache namespaces and sampling-parameter validation (no processes needed)."""

from __future__ import annotations

import gc
import json

import pytest

from radixserve.runtime.wire.errors import ContextLengthExceededError
from radixserve.runtime.wire.sampling_params import LengthLimits, SamplingParams
from radixserve.tokenizer_manager.io import GenerateReqInput, make_namespace, split_requests


def build_sampling_params(params, vocab_size):
    return SamplingParams.from_request(params, vocab_size)


def check_length(params, prompt_len, context_len, max_total_tokens=None, page_size=1):
    return params.fit_context(prompt_len, LengthLimits(context_len, max_total_tokens, page_size))

VOCAB = 1000


def test_namespace_keeps_tenant_and_salt_apart():
    assert make_namespace(None, None) == ()
    assert make_namespace("acme", None) == ("tenant:acme",)
    assert make_namespace(None, "s1") == ("", "salt:s1")
    assert make_namespace("acme", "s1") == ("tenant:acme", "salt:s1")
    # A salt equal to a tenant id never lands in that tenant's namespace.
    assert make_namespace(None, "acme") != make_namespace("acme", None)
    assert make_namespace("", "") == ()


def test_split_single_and_batch():
    [single] = split_requests(GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 3}, rid="r"))
    assert (single.rid, single.text, single.input_ids, single.sampling_params) == ("r", "hi", None, {"max_new_tokens": 3})
    batch = split_requests(GenerateReqInput(
        input_ids=[[1, 2], [3]], sampling_params=[{"temperature": 0}, {"temperature": 1}],
        return_logprob=[True, False], cache_salt="s",
    ))
    # Prompts become tuples of ints, which the cyclic garbage collector stops tracking after one pass.
    assert [r.input_ids for r in batch] == [(1, 2), (3,)]
    gc.collect()
    assert not any(gc.is_tracked(r.input_ids) for r in batch)
    assert [r.sampling_params["temperature"] for r in batch] == [0, 1]
    assert [r.return_logprob for r in batch] == [True, False]
    assert [r.cache_salt for r in batch] == ["s", "s"]
    assert len({r.rid for r in batch}) == 2 and [r.index for r in batch] == [0, 1]
    assert GenerateReqInput(input_ids=[1, 2]).is_single and not GenerateReqInput(input_ids=[[1, 2]]).is_single


@pytest.mark.parametrize("obj, message", [
    (GenerateReqInput(), "exactly one"),
    (GenerateReqInput(text="a", input_ids=[1]), "exactly one"),
    (GenerateReqInput(text=[]), "empty"),
    (GenerateReqInput(text=["a", 1]), "list of strings"),
    (GenerateReqInput(input_ids=[1, "2"]), "list of ints"),
    (GenerateReqInput(input_ids=[[1], [True]]), "list of ints"),
    (GenerateReqInput(text=["a", "b"], sampling_params=[{}]), "1 entries but the batch has 2"),
    (GenerateReqInput(text=["a", "b"], rid="same"), "one rid per prompt"),
    (GenerateReqInput(text=["a", "b"], rid=["x", "x"]), "distinct"),
    (GenerateReqInput(text="a", sampling_params="greedy"), "must be a dict"),
    (GenerateReqInput(text="a", cache_salt=5), "cache_salt"),
])
def test_split_rejects_bad_shapes(obj, message):
    with pytest.raises(ValueError, match=message):
        split_requests(obj)


def test_sampling_params_conversions():
    params = build_sampling_params({
        "max_new_tokens": 5, "temperature": 0, "stop": "###", "stop_token_ids": [7],
        "logit_bias": {"12": 3, 13: -1.5}, "json_schema": {"type": "object"}, "seed": 3, "top_k": 1,
    }, VOCAB)
    assert isinstance(params, SamplingParams)
    assert params.stop == ["###"] and params.stop_token_ids == [7] and params.seed == 3
    assert params.logit_bias == {12: 3.0, 13: -1.5}
    assert json.loads(params.json_schema) == {"type": "object"}
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert build_sampling_params(None, VOCAB) == SamplingParams()


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "integer"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "finite"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": float("inf")}, "finite"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"seed": 2**64}, "seed"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"n": 0}, "n must be"),
    ({"min_new_tokens": 4, "max_new_tokens": 3}, "min_new_tokens"),
    ({"stop": [""]}, "empty"),
    ({"stop": [1]}, "stop must be"),
    ({"stop_token_ids": ["7"]}, "not a token id"),
    ({"stop_token_ids": [-1]}, "not a token id"),
    ({"no_stop_trim": True}, "no_stop_trim: this server does not support keeping the stop string"),
    ({"stream_interval": 4}, "stream_interval"),
    ({"seed": 1, "sampling_seed": 2}, "give one of seed and sampling_seed"),
    ({"logit_bias": {"abc": 1}}, "not a token id"),
    ({"logit_bias": {"-1": 1}}, "outside the vocabulary"),
    ({"ignore_eos": 1}, "true or false"),
    ({"regex": "a", "ebnf": "b"}, "at most one"),
    ({"maxtokens": 3, "temprature": 1}, "unknown sampling parameter\\(s\\): maxtokens, temprature"),
])
def test_sampling_params_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        build_sampling_params(params, VOCAB)


def test_sampling_params_follow_sglang_on_unset_and_foreign_fields():
    # Out-of-vocabulary stop ids can never be sampled: dropped, as SGLang does, not an error.
    assert build_sampling_params({"stop_token_ids": [7, VOCAB, 10**12, 7]}, VOCAB).stop_token_ids == [7]
    # null is unset; SGLang's parameters without a feature here are accepted at their default.
    quiet = build_sampling_params({"temperature": None, "top_p": None, "no_stop_trim": False, "stream_interval": 1,
                                   "stop_regex": None, "custom_params": None, "max_new_tokens": 4}, VOCAB)
    assert quiet == SamplingParams(max_new_tokens=4)
    assert build_sampling_params({"sampling_seed": 9}, VOCAB).seed == 9
    with pytest.raises(ValueError) as error:
        build_sampling_params({"structural_tag": "{}"}, VOCAB)
    assert error.value.field == "structural_tag"


def test_model_defaults_fill_only_unset_fields():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 50, "max_new_tokens": 1, "seed": 5}
    unset = SamplingParams.from_request({"max_new_tokens": 8, "temperature": None}, VOCAB, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 50)
    assert unset.max_new_tokens == 8 and unset.seed is None  # only MODEL_DEFAULT_FIELDS are taken
    given = SamplingParams.from_request({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, VOCAB, defaults)
    assert (given.temperature, given.top_p, given.top_k) == (1.0, 1.0, -1)  # an explicit default value wins
    assert SamplingParams.from_request({}, VOCAB, None) == SamplingParams()


def test_check_length():
    params = build_sampling_params({"max_new_tokens": 10}, VOCAB)
    assert check_length(params, 90, context_len=100).max_new_tokens == 10
    with pytest.raises(ContextLengthExceededError, match="context length of 100"):
        check_length(params, 91, context_len=100)
    with pytest.raises(ContextLengthExceededError, match="KV cache capacity of 50"):
        check_length(params, 45, context_len=100, max_total_tokens=50)
    with pytest.raises(ContextLengthExceededError, match="KV cache capacity of 48"):
        check_length(params, 40, context_len=100, max_total_tokens=50, page_size=16)
    open_ended = build_sampling_params({"max_new_tokens": None}, VOCAB)
    assert check_length(open_ended, 30, context_len=100).max_new_tokens == 70
    with pytest.raises(ContextLengthExceededError):
        check_length(open_ended, 100, context_len=100)
    with pytest.raises(ValueError, match="empty"):
        check_length(params, 0, context_len=100)
