"""SGLang's and vLLM's request fields against a real server: honoured, ignored at their default, or a 400 that
names the missing feature; SGLang's bench_serving (`--backend sglang`) request shapes and end-of-run read.

The bench_serving shapes are reproduced from SGLang's client (its payload keys, its stream reading and its
`/get_server_info` read), since SGLang itself is not a dependency of this project.
"""

from __future__ import annotations

import json

import httpx
import pytest

from http_fixtures import ADMIN_KEY, shared_server

PROMPT = "List three colors:"


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120.0)


def _sglang_bench_request(server, payload: dict) -> tuple[str, int, int]:
    """SGLang's bench_serving reader: each chunk's text replaces the text so far; counts from meta_info."""
    generated, output_len, chunks = "", 0, 0
    with httpx.stream("POST", server.url + "/generate", json=payload, headers=server.headers(),
                      timeout=120.0) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            line = line.strip()
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("text"):
                generated = chunk["text"]
                output_len = chunk["meta_info"]["completion_tokens"]
                chunks += 1
    return generated, output_len, chunks


def test_bench_serving_sglang_backend_shapes(server, default_model_dir):
    from radixserve.runtime.model_files import load_tokenizer

    sampling = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    expected = _post(server, "/generate", {"text": PROMPT, "sampling_params": sampling}).json()
    input_ids = load_tokenizer(default_model_dir).encode(PROMPT)
    assert len(input_ids) == expected["meta_info"]["prompt_tokens"]
    for prompt in ({"text": PROMPT}, {"input_ids": input_ids}):
        payload = {**prompt, "sampling_params": sampling, "stream": True, "lora_path": None,
                   "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
                   "stream_options": {"include_usage": True}}
        text, output_len, chunks = _sglang_bench_request(server, payload)
        assert text == expected["text"] and output_len == 8 and chunks >= 2
    # The end of a run: bench_serving reads internal_states[0] (speculative accept length, absent here).
    for headers in (server.headers(), {"Authorization": f"Bearer {ADMIN_KEY}"}):
        info = httpx.get(server.url + "/get_server_info", headers=headers, timeout=30.0).json()
        assert info["internal_states"][0].get("avg_spec_accept_length") is None


@pytest.mark.parametrize("field, value", [
    ("lora_path", None), ("lora_path", ""), ("lora_path", [None]), ("return_routed_experts", False),
    ("image_data", None), ("return_hidden_states", False), ("priority", None), ("session_params", None),
    ("custom_logit_processor", None), ("log_metrics", True), ("custom_labels", {"team": "a"}),
    ("return_logprob", None), ("top_logprobs_num", None), ("routed_experts_start_len", 0),
])
def test_native_defaults_of_unimplemented_fields_are_accepted(server, field, value):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, field: value}
    response = _post(server, "/generate", body)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("field, value, feature", [
    ("lora_id", "my-adapter", "LoRA"), ("return_routed_experts", True, "routed experts"),
    ("image_data", "https://example.com/cat.png", "multimodal"), ("background", True, "background requests"),
    ("return_hidden_states", True, "hidden states"), ("session_params", {"id": "s"}, "sessions"),
])
def test_native_unimplemented_features_are_a_400_naming_them(server, field, value, feature):
    response = _post(server, "/generate", {"text": PROMPT, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and feature in error["message"]


def test_unknown_fields_and_sampling_params_stay_400(server):
    response = _post(server, "/generate", {"text": PROMPT, "no_such_field": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "no_such_field"
    response = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"no_stop_trim": True}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.no_stop_trim"
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "best_fruit": "kiwi"}).status_code == 400
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True})
    assert response.status_code == 400 and "beam search" in response.json()["error"]["message"]


def test_out_of_vocabulary_stop_token_ids_are_ignored(server):
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(server, "/generate", {"text": PROMPT, "sampling_params": params}).json()
    ignored = _post(server, "/generate", {"text": PROMPT, "sampling_params": {
        **params, "stop_token_ids": [10**9]}}).json()
    assert ignored["output_ids"] == plain["output_ids"]
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "stop_token_ids": [10**9]})
    assert chat.status_code == 200


def test_openai_extensions_at_default_and_extra_message_keys(server):
    body = {"messages": [{"role": "system", "content": "Be brief.", "reasoning_content": None},
                         {"role": "user", "content": "Hi", "some_client_key": 1}],
            "max_tokens": 2, "temperature": 0, "lora_path": None, "separate_reasoning": False,
            "return_hidden_states": False, "rid": "abc", "chat_template_kwargs": {}}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    response = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"tokenize": False}})
    assert response.status_code == 400


def test_continue_final_message_prefills_the_assistant(server, default_model_dir):
    prefix = "The three primary colors are red,"
    messages = [{"role": "user", "content": "Name the three primary colors."},
                {"role": "assistant", "content": prefix}]
    params = {"max_tokens": 6, "temperature": 0}
    continued = _post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                       **params}).json()
    # The same prompt rendered by hand: the template's text up to the end of the assistant's prefix.
    from radixserve.runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith(prefix)  # the assistant's turn stays open
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        continue_final_message=True)["input_ids"]
    raw = _post(server, "/generate", {"input_ids": list(ids), "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}).json()
    assert continued["choices"][0]["message"]["content"] == raw["text"]
    vllm_style = _post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                        "add_generation_prompt": False, **params}).json()
    assert vllm_style["choices"][0]["message"]["content"] == raw["text"]
    for bad in ({"add_generation_prompt": True}, {"messages": messages[:1]}):
        response = _post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                          **params, **bad})
        assert response.status_code == 400


def test_continuous_usage_stats(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                      timeout=120.0) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and events[-1]["usage"]["completion_tokens"] == 4


def test_model_sampling_defaults_fill_unset_fields(server):
    """The embedded model ships SmolLM2's recommended sampling values; a request without them gets them, one
    that sets them keeps its own (a seeded temperature-0.2 request repeats what the seed gives)."""
    info = httpx.get(server.url + "/get_model_info", headers=server.headers(), timeout=30.0).json()
    assert info["info"]["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    prompt = "Write a word:"
    unset = _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 12, "seed": 11}}).json()
    explicit = _post(server, "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 12, "seed": 11, "temperature": 0.2, "top_p": 0.9}}).json()
    assert unset["output_ids"] == explicit["output_ids"]
    chat = {"messages": [{"role": "user", "content": "Write a word."}], "max_tokens": 12, "seed": 11}
    chat_unset = _post(server, "/v1/chat/completions", chat).json()
    chat_explicit = _post(server, "/v1/chat/completions", {**chat, "temperature": 0.2, "top_p": 0.9}).json()
    assert chat_unset["choices"][0]["message"] == chat_explicit["choices"][0]["message"]


def test_the_bodies_sglang_router_forwards_are_accepted(server):
    """Exactly what sglang-router 0.3 sends a worker for a plain chat request and a plain /generate."""
    chat = {"messages": [{"role": "user", "content": "Say hello"}], "model": "SmolLM2-135M-Instruct",
            "logprobs": False, "max_completion_tokens": 2, "stream": False, "no_stop_trim": False,
            "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
    response = _post(server, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    generate = {"text": PROMPT, "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 2},
                "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                "return_entropy": False}
    response = _post(server, "/generate", generate)
    assert response.status_code == 200, response.text
    routed = _post(server, "/generate", {**generate, "data_parallel_rank": 0})  # one replica: rank 0 exists
    assert routed.status_code == 200, routed.text
    for path, body in (("/generate", {**generate, "routed_dp_rank": 1}),
                       ("/v1/chat/completions", {**chat, "data_parallel_rank": 1})):
        response = _post(server, path, body)
        assert response.status_code == 400 and "data_parallel_rank" in response.json()["error"]["message"], path
    held_back = _post(server, "/v1/chat/completions", {**chat, "stream": True, "stream_reasoning": False})
    assert held_back.status_code == 400 and "stream_reasoning" in held_back.json()["error"]["message"]
