"""GenerateRequest and normalize(): the one request every surface decodes into, and what is decided from it once
(batch shape, n expansion, sampling parameters, the cache namespace), down to the scheduler's Req."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import msgspec
import pytest

from radixserve.runtime.wire.compat import (
    NATIVE_UNSUPPORTED,
    OPENAI_UNSUPPORTED,
    SAMPLING_UNSUPPORTED,
    UnsupportedFieldError,
    asks_for_nothing,
)
from radixserve.runtime.wire.messages import (
    ModelInfo, RequestOptions, TokenizedGenerateReq, decode, encode, options_of,
)
from radixserve.runtime.wire.request import (
    SERVER_FIELDS, GenerateRequest, NormalizedRequest, RequestFieldError, make_namespace, normalize,
)
from radixserve.runtime.wire.request_body import decode_json
from radixserve.runtime.wire.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

VOCAB = 1000


def model(dp_size: int = 1, **defaults: float) -> ModelInfo:
    return ModelInfo(context_len=100, vocab_size=VOCAB, max_total_num_tokens=1000, max_running_requests=8,
                     page_size=1, eos_token_ids=[0], model_path=None, device="cpu", dtype="float32",
                     attention_backend="torch_native", chunked_prefill_size=None, schedule_policy="fcfs",
                     overlap_schedule=False, radix_cache=True, sampling_defaults=defaults, dp_size=dp_size)


def test_n_expansion_gives_each_sample_its_rid_and_seed():
    request = normalize(GenerateRequest(text=["a", "b"], rid=["x", "y"], sampling_params={"n": 3, "seed": 7}),
                        model())
    assert [[(s.rid, s.seed) for s in p.samples] for p in request.prompts] == [
        [("x-0", 7), ("x-1", 8), ("x-2", 9)], [("y-0", 7), ("y-1", 8), ("y-2", 9)]]
    assert request.sample_rids() == {"x": ["x-0", "x-1", "x-2"], "y": ["y-0", "y-1", "y-2"]}
    # One sample keeps the caller's rid and seed; a seed at the top of int64 wraps instead of overflowing.
    [one] = normalize(GenerateRequest(text="a", rid="r", sampling_params={"seed": 5}), model()).prompts
    assert [(s.rid, s.seed) for s in one.samples] == [("r", 5)]
    top = normalize(GenerateRequest(text="a", sampling_params={"n": 2, "seed": INT64_MAX}), model()).prompts[0]
    assert [s.seed for s in top.samples] == [INT64_MAX, INT64_MIN]
    assert top.sample_params(top.sampling_params, top.samples[1]) == msgspec.structs.replace(
        top.sampling_params, n=1, seed=INT64_MIN)


def test_per_sample_splits_prompt_major():
    request = normalize(GenerateRequest(input_ids=[[1, 2], [3]], rid=["p", "q"], sampling_params={"n": 2}), model())
    parts = request.per_sample()
    assert [part.prompts[0].samples[0].rid for part in parts] == ["p-0", "p-1", "q-0", "q-1"]
    assert all(part.single and len(part.prompts) == 1 and part.prompts[0].sampling_params.n == 1 for part in parts)
    assert [part.prompts[0].input_ids for part in parts] == [(1, 2), (1, 2), (3,), (3,)]


def test_sampling_defaults_fill_unset_parameters_only():
    [prompt] = normalize(GenerateRequest(text="a", sampling_params={"top_p": 0.5}),
                         model(temperature=0.2, top_p=0.9)).prompts
    assert (prompt.sampling_params.temperature, prompt.sampling_params.top_p) == (0.2, 0.5)
    built = SamplingParams(temperature=1.0)  # built by from_request elsewhere: trusted as it is
    assert normalize(GenerateRequest(text="a", sampling_params=built), model(temperature=0.2)).prompts[
        0].sampling_params == built


@pytest.mark.parametrize("tenant, salt, lora", [(None, None, None), ("acme", "s", None), ("acme", None, "ad"),
                                                (None, "s", "ad")])
def test_the_namespace_is_decided_once_and_travels_to_the_scheduler(tenant, salt, lora):
    from radixserve.scheduler.req import Req

    request = normalize(GenerateRequest(input_ids=[1, 2, 3], cache_salt=salt, lora_path=lora, tenant=tenant,
                                        tenant_weight=2.0, priority=4, return_logprob=True, top_logprobs_num=2),
                        model())
    options = request.prompts[0].options
    assert options.namespace == make_namespace(tenant, salt, lora)
    assert (options.lora_name, options.priority, options.tenant_weight) == (lora, 4, 2.0)
    message = TokenizedGenerateReq(rid="r", input_ids=[1, 2, 3], sampling_params=SamplingParams(),
                                   **options_of(options))
    req = Req.from_message(decode(encode(message)), arrival_seq=3)
    for name in RequestOptions.__struct_fields__:  # every option reaches the scheduler's Req under its name
        assert getattr(req, name) == getattr(options, name), name
    assert req.tenant == (tenant or "") and req.arrival_seq == 3


def test_the_ray_routing_key_is_the_namespace_normalize_decided():
    from radixserve.runtime.ray_serve.proxy import EngineProxy

    async def encode_text(text):
        return [5, 6]

    request = normalize(GenerateRequest(text="hello", cache_salt="s", lora_path="adapter-a", tenant="acme",
                                        sampling_params={"max_new_tokens": 4}), model())
    route = asyncio.run(EngineProxy._route(SimpleNamespace(async_encode=encode_text), request))
    assert route.namespace == request.prompts[0].options.namespace == ("tenant:acme", "salt:s", "lora:adapter-a")
    assert route.key == (5, 6) and route.tokens == 2 + 4


@pytest.mark.parametrize("fields, field, message", [
    ({"text": "a", "data_parallel_rank": 2}, "data_parallel_rank", "data_parallel_rank must be in [0, 2)"),
    ({"input_ids": [1, VOCAB]}, "input_ids", "outside the vocabulary"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "temperature"),
    ({"text": "a", "top_logprobs_num": -1}, "text", "top_logprobs_num"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "distinct"),
    ({"text": ["a", "b"], "cache_salt": ["s"]}, "cache_salt", "1 entries but the batch has 2"),
])
def test_normalize_names_the_field_at_fault(fields, field, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        normalize(GenerateRequest(**fields), model(dp_size=2))
    assert info.value.field == field


def test_a_batch_error_names_its_prompt():
    with pytest.raises(ValueError) as info:
        normalize(GenerateRequest(text=["a", "b"], sampling_params=[{}, {"top_k": 0}]), model())
    assert str(info.value).startswith("prompt 1 of the batch: top_k")
    assert (info.value.field, info.value.prompt) == ("sampling_params.top_k", 1)


def test_decode_json_reads_the_native_body():
    request = decode_json(json.dumps({
        "text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, None], "rid": ["x", "y"], "stream": None,
        "lora_path": [None, None], "log_metrics": True, "return_hidden_states": False, "model": None}).encode())
    assert (request.text, request.rid, request.stream, request.lora_path) == (["a", "b"], ["x", "y"], False, None)


@pytest.mark.parametrize("body, field, message", [
    (b"{", None, "not valid JSON"),
    (b'{"a":' * 2000 + b"1" + b"}" * 2000, None, "nested too deeply"),
    (b"[1]", None, "must be a JSON object"),
    (b'{"text": "a", "no_such_field": 1}', "no_such_field", "Unrecognized request argument supplied"),
    (b'{"text": "a", "top_logprobs_num": "2"}', "top_logprobs_num", "got `str`"),
    (b'{"text": "a", "top_logprobs_num": 21}', "top_logprobs_num", "<= 20"),
    (b'{"input_ids": [1, -2]}', "input_ids[1]", ">= 0"),
    (b'{"text": "a", "sampling_params": [{}]}', "sampling_params", "not a batch"),
    (b'{"text": ["a", "b"], "rid": "r"}', "rid", "list of rids"),
    (b'{"text": "a", "input_ids": [1]}', None, "exactly one"),
])
def test_decode_json_refuses_bad_bodies_naming_the_field(body, field, message):
    with pytest.raises(RequestFieldError, match=message) as info:
        decode_json(body)
    assert info.value.field == field


@pytest.mark.parametrize("name", SERVER_FIELDS)
def test_a_body_cannot_set_what_the_server_decides(name):
    with pytest.raises(RequestFieldError, match="Unrecognized request argument supplied") as info:
        decode_json(json.dumps({"text": "a", name: "x"}).encode())
    assert info.value.field == name


def test_foreign_fields_follow_the_one_rule():
    decode_json(b'{"text": "a", "image_data": [null, ""], "routed_experts_start_len": 0}')
    with pytest.raises(UnsupportedFieldError, match="multimodal") as info:
        decode_json(b'{"text": "a", "image_data": "https://example.com/cat.png"}')
    assert info.value.field == "image_data"
    for value in (None, False, 0, 0.0, "", [], {}, [None, False]):
        assert asks_for_nothing(value)
    for value in (True, 1, "x", [0, 1], {"a": 1}):
        assert not asks_for_nothing(value)
    assert asks_for_nothing(1, default=1) and not asks_for_nothing(2, default=1)  # stream_interval's default
    # The sampling table obeys the same rule: each parameter's own default asks for nothing.
    for name, (default, _) in SAMPLING_UNSUPPORTED.items():
        assert SamplingParams.from_request({name: default}, VOCAB) == SamplingParams()
    assert set(NATIVE_UNSUPPORTED) & set(GenerateRequest.__struct_fields__) == set()
    assert set(OPENAI_UNSUPPORTED) & set(GenerateRequest.__struct_fields__) == set()


def test_the_engine_keywords_are_the_request_fields():
    from radixserve.runtime.engine import _request

    request = _request("hi", {"max_new_tokens": 2}, {"cache_salt": "s", "lora_path": "a", "priority": 1,
                                                      "logprob_start_len": None})
    assert isinstance(request, GenerateRequest) and request.text == "hi" and request.cache_salt == "s"
    for name in (*SERVER_FIELDS, "text", "no_such_keyword"):
        with pytest.raises(TypeError, match=name):
            _request("hi", None, {name: 1})
    assert isinstance(normalize(request, model()), NormalizedRequest)


def test_a_pooling_request_prefills_only_and_travels_to_the_scheduler():
    from radixserve.runtime.wire.pooling import PoolingParams
    from radixserve.scheduler.req import Req

    score = PoolingParams(kind="score", label_token_ids=(3, 4))
    normalized = normalize(GenerateRequest(input_ids=[[1, 2], [5]], pooling=score), model())
    for prompt in normalized.prompts:
        assert prompt.sampling_params.max_new_tokens == 0 and prompt.options.pooling == score
    message = decode(encode(TokenizedGenerateReq(rid="r", input_ids=[1, 2], sampling_params=normalized.prompts[0]
                                                 .sampling_params, **options_of(normalized.prompts[0].options))))
    assert Req.from_message(message, 0).pooling == score


@pytest.mark.parametrize("fields, served, message", [
    ({"pooling": {"kind": "embed"}}, ["score"], "cannot serve embed"),
    ({"pooling": {"kind": "score"}}, ["score"], "label_token_ids"),
    ({"pooling": {"kind": "score", "label_token_ids": [VOCAB]}}, ["score"], "outside the vocabulary"),
    ({"pooling": {"kind": "embed"}, "stream": True}, ["embed"], "cannot stream"),
    ({"pooling": {"kind": "embed"}, "sampling_params": {"max_new_tokens": 3}}, ["embed"], "no sampling_params"),
    ({"pooling": {"kind": "embed"}, "return_logprob": True}, ["embed"], "no logprobs"),
    ({}, ["embed"], "does not generate"),
])
def test_pooling_requests_the_model_cannot_serve_are_refused(fields, served, message):
    from radixserve.runtime.wire.pooling import PoolingParams

    if "pooling" in fields:
        fields = {**fields, "pooling": msgspec.convert(fields["pooling"], PoolingParams)}
    info = msgspec.structs.replace(model(), pooling_kinds=served, is_generation="score" in served)
    with pytest.raises(RequestFieldError, match=message):
        normalize(GenerateRequest(input_ids=[1, 2], **fields), info)


def test_what_a_request_may_multiply_is_bounded_by_the_server_arguments():
    """n, stop strings and logit_bias past --max-request-n, --max-stop-strings, --max-stop-string-length and
    --max-logit-bias-tokens are a ValueError naming the field and the flag (a 400 over HTTP); at the limit they
    pass. The limits travel in ModelInfo, so every surface's normalize() applies the scheduler's values."""
    from radixserve.runtime.wire.sampling_params import RequestLimits
    from radixserve.runtime.wire.server_args import ServerArgs

    limits = ServerArgs(max_request_n=4, max_stop_strings=2, max_stop_string_length=5,
                        max_logit_bias_tokens=3).request_limits()
    assert limits == RequestLimits(max_request_n=4, max_stop_strings=2, max_stop_string_length=5,
                                   max_logit_bias_tokens=3)
    bounded = msgspec.structs.replace(model(), request_limits=limits)
    at_limit = {"n": 4, "stop": ["ab", "abcde"], "logit_bias": {"1": 1.0, "2": 1.0, "3": 1.0}}
    normalize(GenerateRequest(text="a", sampling_params=at_limit), bounded)
    for field, value, flag in [("n", 5, "--max-request-n"), ("stop", ["a", "b", "c"], "--max-stop-strings"),
                               ("stop", ["abcdef"], "--max-stop-string-length"),
                               ("logit_bias", {str(i): 1.0 for i in range(4)}, "--max-logit-bias-tokens")]:
        with pytest.raises(ValueError, match=flag) as error:
            normalize(GenerateRequest(text="a", sampling_params={field: value}), bounded)
        assert error.value.field == f"sampling_params.{field}"
    with pytest.raises(ValueError, match="--max-request-n"):  # the defaults bound an unconfigured server
        normalize(GenerateRequest(text="a", sampling_params={"n": 129}), model())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(bounded), type=ModelInfo).request_limits == limits
