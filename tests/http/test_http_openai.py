"""The OpenAI API over a real server process on the embedded model, through the real `openai` client.

Greedy requests must give the same text streamed and not; every choice ends with exactly one finish
reason; errors raise the client's matching exception class with the envelope fields set."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from http_fixtures import KEY_A, shared_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


MESSAGES = [{"role": "user", "content": "List three colors of the rainbow."}]
PROMPT = "The three primary colors are"


def _stream_texts(chunks) -> tuple[dict[int, str], dict[int, list[str]]]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes


def test_idle_connection_outlives_the_client_pool(server):
    """A keep-alive connection left idle past the openai client's pool expiry (httpx's 5 s) still answers: the
    client closes its idle connections first, so it never sends a request on a socket the server is closing."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for pause in (0.0, 6.0):
            time.sleep(pause)
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), f"no answer after {pause} s idle"


def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and model == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


def test_chat_stream_equals_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 16 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.prompt_tokens_details.cached_tokens <= full.usage.prompt_tokens

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    texts, finishes = _stream_texts(chunks)
    assert texts == {0: choice.message.content} and finishes == {0: [choice.finish_reason]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n2_seeded_is_reproducible_and_streams_the_same(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1234, n=2)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    texts, finishes = _stream_texts(client.chat.completions.create(**kwargs, stream=True))
    assert texts == {c.index: c.message.content for c in first.choices}
    assert finishes == {c.index: [c.finish_reason] for c in first.choices}


def test_completions_stream_equals_non_stream_and_echo(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text
    texts, finishes = _stream_texts(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                              temperature=0, stream=True))
    assert texts == {0: full.choices[0].text} and finishes == {0: [full.choices[0].finish_reason]}
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + full.choices[0].text
    texts, _ = _stream_texts(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                                       echo=True, stream=True))
    assert texts == {0: PROMPT + full.choices[0].text}


def test_completions_batch_of_prompts_and_token_ids(server, client, model):
    single = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    other = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    batch = client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=6,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [single.choices[0].text] * 2 + [other.choices[0].text] * 2
    # Each prompt counts once in usage, whatever n is.
    assert batch.usage.prompt_tokens == single.usage.prompt_tokens + other.usage.prompt_tokens
    assert batch.usage.completion_tokens == 2 * (single.usage.completion_tokens + other.usage.completion_tokens)

    native = httpx.post(server.url + "/generate", headers=server.headers(), timeout=60.0, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert native["text"] == single.choices[0].text
    ids = native["output_ids"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    native_by_ids = httpx.post(server.url + "/generate", headers=server.headers(), timeout=60.0, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert by_ids.choices[0].text == native_by_ids["text"]
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_logprobs(client, model):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        logprobs = [top.logprob for top in entry.top_logprobs]
        assert logprobs == sorted(logprobs, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    if response.choices[0].finish_reason == "length":
        assert bytes(b for e in content for b in e.bytes).decode() == response.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    streamed_content = [e for c in streamed if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_content] == [(e.token, round(e.logprob, 4))
                                                                         for e in content]


def test_completions_logprobs(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens
    assert logprobs.text_offset[0] == len(PROMPT)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0.0 and len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert top[token] == pytest.approx(logprob, abs=1e-6)


def test_echo_with_logprobs_returns_prompt_logprobs(server, client, model):
    """echo + logprobs reports every prompt token (the first one's logprob is null), with the same values as
    the native route's input_token_logprobs, followed by the completion."""
    native = httpx.post(server.url + "/generate", headers=server.headers(), timeout=60.0, json={
        "text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    prompt_entries = native["meta_info"]["input_token_logprobs"]
    prompt_len = native["meta_info"]["prompt_tokens"]
    assert len(prompt_entries) == prompt_len and prompt_entries[0][0] is None
    assert all(lp is not None and lp <= 0 for lp, _, _ in prompt_entries[1:])
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True).choices[0].logprobs
    assert echoed.token_logprobs[0] is None and echoed.text_offset[0] == 0
    assert len(echoed.tokens) == prompt_len + 1 and "".join(echoed.tokens).startswith(PROMPT)
    assert echoed.token_logprobs[1:prompt_len] == pytest.approx([lp for lp, _, _ in prompt_entries[1:]], abs=1e-4)
    # Prompt and generated positions have one shape: the 2 most likely tokens and always the chosen one.
    for position in range(1, prompt_len + 1):
        top = echoed.top_logprobs[position]
        assert 2 <= len(top) <= 3 and max(top.values()) >= echoed.token_logprobs[position] - 1e-4
        assert top[echoed.tokens[position]] == pytest.approx(echoed.token_logprobs[position], abs=1e-4)


def test_completions_logprobs_zero_gives_the_chosen_token(client, model):
    """logprobs=0 (as OpenAI and vLLM): each position's top_logprobs holds the chosen token alone, prompt
    positions too when echoing (the first prompt token has nothing before it: null)."""
    for echo in (False, True):
        logprobs = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                             echo=echo).choices[0].logprobs
        start = 1 if echo else 0
        if echo:
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for token, logprob, top in list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))[start:]:
            assert top == {token: pytest.approx(logprob, abs=1e-6)}


def test_response_format_json_schema_and_object(client, model):
    """JSON output parses and follows the schema; json_object gives an object."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"]}
    messages = [{"role": "user", "content": "Give me a JSON object with a name."}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}).choices[0]
    assert reply.finish_reason == "stop", reply
    assert set(json.loads(reply.message.content)) == {"name"}
    streamed, finishes = _stream_texts(client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}))
    assert streamed == {0: reply.message.content} and finishes == {0: ["stop"]}
    any_object = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                                response_format={"type": "json_object"}).choices[0]
    if any_object.finish_reason == "stop":
        assert isinstance(json.loads(any_object.message.content), dict)
    else:
        assert any_object.message.content.startswith("{")
    completion = client.completions.create(model=model, prompt="A person as JSON:", max_tokens=40, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema",
                                                                           "json_schema": {"name": "p",
                                                                                           "schema": schema}}})
    assert set(json.loads(completion.choices[0].text)) == {"name"}


def test_regex_and_ebnf_extras(client, model):
    import re

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                          max_tokens=5, temperature=0, extra_body={"regex": "(yes|no)"})
    assert re.fullmatch("(yes|no)", chat.choices[0].message.content)
    date = client.completions.create(model=model, prompt="Today's date is", max_tokens=16, temperature=0,
                                     extra_body={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}).choices[0]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    color = client.completions.create(model=model, prompt="My favourite color:", max_tokens=5, temperature=0,
                                      extra_body={"ebnf": 'root ::= " red" | " green" | " blue"'}).choices[0]
    assert color.text in (" red", " green", " blue")


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"extra_body": {"regex": "(unclosed"}}, "regex", "regex"),
    ({"extra_body": {"ebnf": "root ::= missing_rule"}}, "ebnf", "missing_rule"),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf", "at most one"),
])
def test_invalid_constraints_are_400s_naming_the_problem(client, model, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.param == param and words in info.value.body["message"]
    extra_body = kwargs.get("extra_body") or {"response_format": kwargs["response_format"]}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra_body)
    assert info.value.param == param


def test_stop_strings(client, model):
    base = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    text = base.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    expected = text[: text.index(stop)]
    stopped = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                             stop=[stop, "never-generated-xyz"])
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["matched_stop"] == stop
    texts, finishes = _stream_texts(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                                                   temperature=0, stop=stop, stream=True))
    assert texts == {0: expected} and finishes == {0: ["stop"]}


def test_client_errors_raise_the_matching_exceptions(server, client, model):
    def bad(**kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kwargs)
        assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
        assert info.value.body["message"]
        return info.value

    assert bad(extra_body={"foo": 1}).param == "foo"
    assert bad(temperature=5).param == "temperature"
    assert bad(n=0).param == "n"
    assert bad(logit_bias={"999999": 1}).param == "logit_bias"
    assert bad(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]).param == "tools"
    assert bad(extra_body={"max_tokens": 10**7}).code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[[1] * 20000], max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model=f"{model}:no-such-adapter", messages=MESSAGES, max_tokens=4)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    for key in ("wrong-key", ""):
        other = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0)
        if not key:
            other = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            other.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert info.value.status_code == 401 and info.value.body["message"]

    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                 ("POST", "/v1/models", 405)):
        response = httpx.request(method, server.url + path, headers=server.headers())
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_queue_full_is_503_with_retry_after(server, client, model):
    # The server holds 8 running + 4 queued sequences: one request with n=12 fills it.
    body = {"model": model, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "n": 12, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60.0) as filling:
        assert filling.status_code == 200
        lines = filling.iter_lines()  # keep the iterator: dropping it would close the connection
        assert next(lines).startswith("data: ")
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "queue_full"
        assert int(info.value.response.headers["retry-after"]) >= 1
        too_big = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(),
                             json={**body, "n": 13, "stream": False})
        assert too_big.status_code == 400  # can never fit: a client error, not a retry
    server.wait_idle(timeout=5.0)
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices[0].message.content


def test_client_dropped_mid_stream_is_aborted_and_frees_kv(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60.0) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in received)
        assert server.server_info()["num_running_reqs"] == 1
    dropped_at = time.monotonic()
    info = server.wait_idle(timeout=5.0)
    assert time.monotonic() - dropped_at < 2.0
    assert info["memory"]["protected_tokens"] == 0


def test_client_dropped_while_waiting_for_a_non_stream_answer_is_aborted(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=1.5)
    dropped_at = time.monotonic()
    server.wait_idle(timeout=5.0)
    assert time.monotonic() - dropped_at < 2.0
