"""What SGLang's and vLLM's own tests, clients and launch lines send, against a real server: each test sends the
exact request (or launch line) a user of those servers meets, through the official `openai` client or httpx.

Where a test ports one of those projects' own tests, its docstring names the test it follows. The server is
launched as SGLang's OpenAI-server tests launch theirs (a tool-call parser), with SGLang's spellings `--dp 1`
and `--chat-template chatml` (the other launch spellings: tests/compat/test_sglang_flags.py).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from http_fixtures import ServerProcess

pytestmark = [pytest.mark.timeout(900)]  # a server of its own: one core case runs in `make test`, the rest are slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# The tool of SGLang's test_function_calling_format: "int" is not a JSON Schema type.
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Compute the sum of two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "int", "description": "A number"},
                                                    "b": {"type": "int", "description": "A number"}},
                   "required": ["a", "b"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--tool-call-parser", "hermes", "--dp", "1", "--chat-template", "chatml",
                            "--max-running-requests", "8", "--log-level", "warning")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300.0)


# ---- 1. model names ---------------------------------------------------------------------------------------------

def test_any_model_name_runs_the_served_model(client, model):
    """SGLang's OpenAI-server tests name their own model (`meta-llama/Llama-3.1-8B-Instruct`); other clients send
    "default". Both run the one model served, with the served model's output."""
    served = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    for name in ("default", "meta-llama/Llama-3.1-8B-Instruct"):
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == served.choices[0].message.content
        completion = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4,
                                               temperature=0)
        assert completion.choices[0].text and completion.model == model


@pytest.mark.slow
def test_a_name_that_picks_an_adapter_not_loaded_is_a_404(client, model):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model=f"{model}:no-such-adapter", messages=MESSAGES, max_tokens=4)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("default")  # a lookup by name still finds only what is served


# ---- 2. tool schemas passed through -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_schema_the_grammar_cannot_compile_passes_where_nothing_compiles_it(client):
    """After SGLang's test_function_calling_format (test/srt/openai_server/function_call/
    test_openai_function_calling.py, sgl-project/sglang commit 0b396b3): its `{"type": "int"}` tool, its model
    name, tool_choice left out (auto), sampled. Served, as SGLang serves it (whether the 135M model calls `add` is
    the answer's quality; a call it makes is `add` with an object of arguments); with "none" too; with
    "required" (the schema would be enforced as written) a 400 naming the tool."""
    messages = [{"role": "system", "content": "You can call functions; answer with a call when one fits."},
                {"role": "user", "content": "Compute (3+5)"}]
    request = dict(model="meta-llama/Llama-3.1-8B-Instruct", messages=messages, tools=[ADD_TOOL], max_tokens=24)
    for choice in ({}, {"tool_choice": "none"}):
        response = client.chat.completions.create(temperature=0.8, top_p=0.8, seed=1, **request, **choice)
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for call in response.choices[0].message.tool_calls or []:
            assert call.function.name == "add" and isinstance(json.loads(call.function.arguments), dict)
        assert not choice or response.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(tool_choice="required", **request)
    assert info.value.param == "tools" and "tools[0].function.parameters" in info.value.message


# ---- 3. vLLM's fields -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_vllm_structured_outputs(client, model):
    """vLLM's structured_outputs forms, as its test_structured_outputs_choice_chat, _json_chat, _regex_chat and
    _type_error send them (tests/entrypoints/openai/chat_completion/test_chat.py, vllm-project/vllm); the
    135M model's answers are checked against the constraint only."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    request = dict(model=model, messages=[{"role": "user", "content": "Name a city as JSON."}], max_tokens=40,
                   temperature=0)
    text = client.chat.completions.create(**request, extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(text.choices[0].message.content), schema)
    text = client.chat.completions.create(**request, extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}})
    assert re.fullmatch("[A-Z][a-z]{2,8}", text.choices[0].message.content)
    choices = ["Paris", "Lima", "Oslo"]
    text = client.completions.create(model=model, prompt="The capital of Peru is", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"choice": choices}})
    assert text.choices[0].text in choices
    grammar = 'root ::= "yes" | "no"'
    text = client.chat.completions.create(**request, extra_body={"structured_outputs": {"grammar": grammar}})
    assert text.choices[0].message.content in ("yes", "no")
    for bad, param in (({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                       ({"structured_outputs": {"json": schema}, "regex": "a"}, "structured_outputs"),
                       ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
                       ({"structured_outputs": {"regex": {1: "Python", 2: "C++"}}}, "structured_outputs"),
                       ({"guided_json": schema}, "guided_json")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**request, extra_body=bad)
        assert info.value.param and info.value.param.startswith(param), (bad, info.value)
    assert "structured_outputs" in info.value.message  # guided_json: the message names the alternative


@pytest.mark.slow
def test_vllm_spaces_between_special_tokens(client, model):
    """A fast tokenizer (the only kind here, and vLLM's default) joins special tokens the same either way."""
    outputs = [client.completions.create(model=model, prompt="<|im_start|>user\nHi<|im_end|>\n", max_tokens=6,
                                         temperature=0, extra_body={"spaces_between_special_tokens": value,
                                                                    "skip_special_tokens": False})
               for value in (True, False)]
    assert outputs[0].choices[0].text == outputs[1].choices[0].text


@pytest.mark.slow
def test_vllm_chat_echo(client, model):
    """After vLLM's test_chat_session_with_echo_and_continue_final_message (tests/entrypoints/openai/
    chat_completion/test_chat_echo.py, vllm-project/vllm commit 41c5903), both cases: with echo the reply holds
    the assistant's prefix (here: starts with it, streamed or not), without it not. max_tokens bounds the 135M
    model's answer, so its finish reason is not asserted."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True})
    echoed = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=extra)
    assert echoed.choices[0].message.content == "The capital of France is" + plain.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=extra, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == \
        echoed.choices[0].message.content
    no_prefix = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                               extra_body={"echo": True})
    assert not no_prefix.choices[0].message.content.startswith(MESSAGES[0]["content"])  # a user turn: not echoed


# ---- 4. launch spellings ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_chatml_renders_chatml(server, default_model_dir):
    """`--chat-template chatml` (the launch line above): the conversation's ids are ChatML's, token for token."""
    from radixserve.runtime.model_files import load_tokenizer

    ids = _post(server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES]}).json()
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ids["tokens"] == load_tokenizer(default_model_dir).encode(text, add_special_tokens=False)


def test_triton_attention_on_a_cpu_is_refused_at_start(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's CPU kernel tests run Triton's interpreter
    process = ServerProcess("--attention-backend", "triton", "--device", "cpu", "--log-level", "warning", wait=False)
    try:
        assert process.process.wait(240) != 0
        assert "the triton attention backend needs a CUDA device" in process.log_text()
    finally:
        process.stop()


# ---- 5. native streams with logprobs ----------------------------------------------------------------------------

@pytest.mark.slow
def test_native_stream_with_logprobs_reports_their_length(server):
    """The shape SGLang's test_stream_logprobs reads: every chunk's meta_info has output_token_logprobs_length,
    the number of output logprobs so far (here: the chunk's cumulative list)."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True},
            "return_logprob": True, "stream": True}
    lengths = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=300.0) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                meta = json.loads(line[len("data: "):])["meta_info"]
                assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"])
                lengths.append(meta["output_token_logprobs_length"])
    assert lengths[-1] == 6 and lengths == sorted(lengths)
    result = _post(server, "/generate", {**body, "stream": False}).json()
    assert result["meta_info"]["output_token_logprobs_length"] == 6


# ---- 7. vLLM-only shapes ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_custom_chat_roles_reach_the_template(server, client, model):
    """After vLLM's test_custom_role (tests/entrypoints/openai/chat_completion/test_chat.py, vllm-project/vllm):
    a `my-custom-role` message, as a string or as text parts, gives the same answer; the role is in the rendered
    prompt as the template writes it."""
    answers = [client.chat.completions.create(
        model=model, messages=[{"role": "my-custom-role", "content": content}], max_tokens=6, temperature=0,
        seed=0).choices[0].message.content for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert answers[0] and answers[0] == answers[1]
    ids = _post(server, "/tokenize", {"messages": [{"role": "my-custom-role", "content": "hi"}]}).json()
    assert ids["tokens"][:4] == _post(server, "/tokenize", {"prompt": "<|im_start|>my-custom-role\nhi",
                                                             "add_special_tokens": False}).json()["tokens"][:4]


@pytest.mark.slow
def test_top_k_zero_is_no_limit(client, model):
    """vLLM's top_k 0 on its routes is SGLang's -1 (off): a seeded sample is the same under both."""
    texts = {top_k: client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, seed=7,
                                              temperature=1.0, extra_body={"top_k": top_k}).choices[0].text
             for top_k in (0, -1)}
    assert texts[0] == texts[-1]


@pytest.mark.slow
def test_vllm_tokenize_chat(server, model, default_model_dir):
    """After vLLM's test_tokenize_chat and test_tokenize_chat_with_tools (tests/entrypoints/openai/
    test_tokenization.py, vllm-project/vllm commit 0091c95): every combination of add_generation_prompt,
    add_special_tokens and continue_final_message, with and without tools, gives the ids of the rendered
    conversation (here ChatML, the server's --chat-template) tokenized with those special tokens."""
    from radixserve.runtime.model_files import load_tokenizer
    from radixserve.tokenizer_manager.chat_templates import CHATML

    tokenizer = load_tokenizer(default_model_dir)
    for tools in (None, [WEATHER_TOOL]):
        for add_generation in (False, True):
            for add_special in (False, True):
                for continue_final in (False, True):
                    if add_generation and continue_final:
                        continue
                    conversation = [{"role": "user", "content": "Hi there!"},
                                    {"role": "assistant", "content": "Nice to meet you!"},
                                    {"role": "user", "content": "Can I ask a question?"}]
                    if continue_final:
                        conversation.append({"role": "assistant", "content": "Sure,"})
                    text = tokenizer.apply_chat_template(conversation, chat_template=CHATML, tokenize=False,
                                                         add_generation_prompt=add_generation,
                                                         continue_final_message=continue_final, tools=tools)
                    body = {"model": model, "messages": conversation, "add_generation_prompt": add_generation,
                            "add_special_tokens": add_special, "continue_final_message": continue_final,
                            **({"tools": tools} if tools else {})}
                    result = _post(server, "/tokenize", body).json()
                    tokens = tokenizer.encode(text, add_special_tokens=add_special)
                    assert result["tokens"] == tokens and result["count"] == len(tokens)
                    assert result["token_strs"] is None


@pytest.mark.slow
def test_vllm_utility_routes(server, model, default_model_dir):
    """After vLLM's test_tokenize_completions, test_tokenize_with_return_token_strs and test_detokenize
    (tests/entrypoints/openai/test_tokenization.py, vllm-project/vllm commit 0091c95), and its /version and
    /ping."""
    from radixserve.runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    prompt = "Hello there, world"
    for add_special in (False, True):
        tokenized = _post(server, "/tokenize", {"model": model, "prompt": prompt,
                                                "add_special_tokens": add_special}).json()
        assert tokenized["tokens"] == tokenizer.encode(prompt, add_special_tokens=add_special)
        assert tokenized["token_strs"] is None
    tokenized = _post(server, "/tokenize", {"model": model, "prompt": prompt, "return_token_strs": True}).json()
    assert tokenized["tokens"] == tokenizer.encode(prompt) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["token_strs"] == tokenizer.convert_ids_to_tokens(tokenized["tokens"])
    assert tokenized["max_model_len"] > 0
    assert _post(server, "/detokenize", {"model": model, "tokens": tokenized["tokens"]}).json() == {"prompt": prompt}
    bad = _post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", {"prompt": 5}).status_code == 400


# ---- 8. a streamed tool call cut by max_tokens ------------------------------------------------------------------

@pytest.mark.slow
def test_a_streamed_call_cut_by_max_tokens_comes_out_as_a_call(client, model):
    """The name streams as a tool-call delta as soon as it is written, the arguments as they come; the raw
    `<tool_call>` text never appears as content."""
    request = dict(model=model, messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
                   tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, temperature=0)
    whole = client.chat.completions.create(max_tokens=60, **request)
    call = whole.choices[0].message.tool_calls[0]
    cut = whole.usage.completion_tokens - 4  # inside the arguments: `"}` and `</tool_call>` are still to come
    content, names, arguments, finishes = "", [], "", []
    for chunk in client.chat.completions.create(max_tokens=cut, stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finishes += [choice.finish_reason] if choice.finish_reason else []
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.id else []
                arguments += delta.function.arguments or ""
    assert names == [call.function.name] and finishes == ["length"]
    assert "<tool_call>" not in content and not content.strip()
    assert arguments and call.function.arguments.startswith(arguments)
