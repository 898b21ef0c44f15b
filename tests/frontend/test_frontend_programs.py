"""DSL programs end to end on the embedded default model (CPU): an in-process Engine and a real HTTP server.

One Engine serves the module; the HTTP tests use the session's shared server ("main", tenant key A, room for
8 running + 4 queued requests, so a 32-program batch also exercises the endpoint's 503 retry). Generations
are a few tokens long.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from http_fixtures import KEY_A, shared_server
from radixserve.frontend import (
    EngineBackend,
    RuntimeEndpoint,
    assistant_begin,
    assistant_end,
    function,
    gen,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
)
from radixserve.frontend.choices import choice_span, unconditional_context_token
from radixserve.runtime.engine import Engine


@pytest.fixture(scope="module")
def engine():
    with Engine(log_level="warning") as engine:
        yield engine


@pytest.fixture(scope="module")
def engine_backend(engine):
    return EngineBackend(engine)


@pytest.fixture(scope="module")
def server():
    return shared_server("main")


@pytest.fixture(scope="module")
def endpoint(server):
    # The administrator's key: these tests flush the cache and read the server-wide prefill counters.
    with RuntimeEndpoint(server.url, api_key=server.admin_key) as backend:
        yield backend


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- acceptance: fork(3) + select on both backends ---------------------------------------------------

@function
def tips(s, topic, branch_states):
    s += system("You are a concise assistant. Answer in one short sentence.")
    s += user(f"Give me three practical tips about {topic}.")
    s += assistant_begin()
    forks = s.fork(3)
    branch_states.extend(forks)
    for i, branch in enumerate(forks):
        branch += f"Tip {i + 1}:" + gen("tip", max_tokens=6, stop="\n") + "\n"
    forks.join("concate_and_append")
    s += "The most useful tip is number" + select("best", [" 1", " 2", " 3"])
    s += assistant_end()


def run_tips(backend):
    """Run `tips` on a cold cache; returns (state, branch states, server info before, server info after)."""
    assert backend.flush_cache()
    before = backend.get_server_info()
    branches = []
    state = tips.run(topic="sleep", branch_states=branches, temperature=0.0, backend=backend)
    return state, branches, before, backend.get_server_info()


def test_fork_and_select_same_greedy_results_on_both_backends_with_the_prefix_computed_once(engine_backend,
                                                                                            endpoint):
    outcomes = {}
    for name, backend in (("engine", engine_backend), ("http", endpoint)):
        state, branches, before, after = run_tips(backend)
        fork_text = branches[0].text().rsplit("Tip 1:", 1)[0]
        prefix_ids = backend.encode(fork_text)
        assert len(prefix_ids) > 30
        for i, branch in enumerate(branches):
            meta = branch.get_meta_info("tip")
            shared = common_prefix_len(prefix_ids, backend.encode(fork_text + f"Tip {i + 1}:"))
            # The fork prefilled the shared text once; every branch found it in the radix cache.
            assert meta["cached_tokens"] >= shared - 1, (name, i, meta)
            assert meta["prompt_tokens"] - meta["cached_tokens"] <= len(backend.encode(f"Tip {i + 1}:")) + 2
        matched = after["cache"]["matched_tokens"] - before["cache"]["matched_tokens"]
        assert matched >= 3 * (len(prefix_ids) - 2)
        outcomes[name] = {
            "text": state.text(),
            "tips": [branch["tip"] for branch in branches],
            "best": state["best"],
            "scores": state.get_meta_info("best")["scores"],
            "messages": state.messages(),
        }
    engine_out, http_out = outcomes["engine"], outcomes["http"]
    assert engine_out["tips"] == http_out["tips"] and engine_out["best"] == http_out["best"]
    assert engine_out["text"] == http_out["text"] and engine_out["messages"] == http_out["messages"]
    # The two servers' radix caches hold different text by now, so a prompt's tokens may come from the cache in one and
    # from a fresh prefill in the other: the embedded GGUF's blocks round activations to 16 bits, which carries those
    # paths' last-bit differences into logprobs at the 1e-4 .. 1e-3 scale (docs/quantization.md).
    assert engine_out["scores"] == pytest.approx(http_out["scores"], abs=2e-3)
    text = engine_out["text"]
    for i, tip in enumerate(engine_out["tips"]):
        assert f"Tip {i + 1}:{tip}\n" in text
    assert text.endswith("The most useful tip is number" + engine_out["best"] + "<|im_end|>\n")
    assert engine_out["messages"][-1]["role"] == "assistant"


# ---- acceptance: select equals Hugging Face logprobs ------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_token_logprobs(hf_model, ids: list[int], start: int) -> list[float]:
    """logprob(ids[j] | ids[:j]) for j >= start, from one Hugging Face forward pass."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's processes share the cores; oversubscription is slow
    try:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].float()
    finally:
        torch.set_num_threads(threads)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[j - 1, ids[j]].item() for j in range(start, len(ids))]


CITIES = ["Paris", "London", "Berlin"]
PREFIX = "The capital of France is "


@function
def capital(s, method):
    s += PREFIX + select("city", CITIES, choices_method=method)


def test_select_picks_paris_with_hugging_face_scores(engine, hf_model):
    tokenizer = engine.tokenizer
    set_default_backend(engine)
    prefix_ids = tokenizer.encode(PREFIX)
    expected_tokens, expected_logprobs, unconditional = [], [], []
    context = unconditional_context_token(tokenizer)
    for city in CITIES:
        ids = tokenizer.encode(PREFIX + city)
        start = choice_span(prefix_ids, ids)
        expected_tokens.append(ids[start:])
        expected_logprobs.append(hf_token_logprobs(hf_model, ids, start))
        unconditional.append(hf_token_logprobs(hf_model, [context] + ids[start:], 1))
    # The trailing space of the prefix merges into the choice's first token (" Paris"), which is scored.
    assert expected_tokens[0] == tokenizer.encode(" Paris")

    means = [sum(lps) / len(lps) for lps in expected_logprobs]
    references = {
        token_length_normalized: means,
        greedy_token_selection: [lps[0] for lps in expected_logprobs],
        unconditional_likelihood_normalized: [
            sum(c - u for c, u in zip(cond, uncond)) / len(cond)
            for cond, uncond in zip(expected_logprobs, unconditional)
        ],
    }
    # The engine serves the embedded GGUF on its blocks, which on AVX-512 VNNI CPUs round the activations to 16 bits:
    # its logprobs sit within a few 1e-3 of the float weights' (docs/quantization.md: 0.0005 mean, 0.006 at most over
    # 16 x 32 greedy tokens), the float path's within 1e-4.
    tolerance = 5e-3
    for method, expected_scores in references.items():
        state = capital.run(method=method)
        meta = state.get_meta_info("city")
        assert meta["token_ids"] == expected_tokens
        for got, want in zip(meta["token_logprobs"], expected_logprobs):
            assert got == pytest.approx(want, abs=tolerance)
        assert meta["scores"] == pytest.approx(expected_scores, abs=tolerance), method
        assert meta["normalized_logprobs"] == pytest.approx(means, abs=tolerance)
        assert meta["decision"] == max(range(3), key=lambda i: expected_scores[i])
        assert state.text() == PREFIX + state["city"]
    assert capital.run(method=token_length_normalized)["city"] == "Paris"


# ---- acceptance: run_batch over a shared 400-token few-shot prefix ----------------------------------

# The same few-shot prompt as benchmarks/dsl_run_batch.py (about 400 tokens).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from dsl_run_batch import FEW_SHOT  # noqa: E402

REVIEWS = [f"Review number {i}: the {adjective} film {verdict}."
           for i, (adjective, verdict) in enumerate(
               [(a, v) for a in ("new", "old", "long", "short", "French", "quiet", "loud", "strange")
                for v in ("was wonderful", "bored me", "made me laugh", "was a disaster")])]


@function
def classify(s, review):
    s += FEW_SHOT
    s += "Review: " + review + "\nSentiment:" + gen("label", max_tokens=2, stop="\n")


def test_run_batch_computes_the_shared_prefix_once(endpoint, server):
    assert len(REVIEWS) == 32
    prefix_ids = endpoint.encode(FEW_SHOT)
    assert 380 <= len(prefix_ids) <= 460
    server.wait_idle()
    assert endpoint.flush_cache()
    before = endpoint.get_server_info()["prefill_tokens_computed"]
    states = classify.run_batch([{"review": review} for review in REVIEWS], backend=endpoint, temperature=0.0)
    computed = endpoint.get_server_info()["prefill_tokens_computed"] - before
    suffixes = 0
    for state, review in zip(states, REVIEWS):
        assert state.error is None
        prompt_ids = endpoint.encode(FEW_SHOT + "Review: " + review + "\nSentiment:")
        suffixes += len(prompt_ids) - common_prefix_len(prefix_ids, prompt_ids)
        assert state.get_meta_info("label")["prompt_tokens"] == len(prompt_ids)
        assert state["label"].strip() in {"positive", "negative"}
    assert computed <= 1.1 * (len(prefix_ids) + suffixes), (computed, len(prefix_ids), suffixes)
    assert computed >= len(prefix_ids)


# ---- roles, streaming, branches, errors --------------------------------------------------------------

@function
def chat(s, question):
    s += system("You answer with a single word.")
    s += user(question)
    with s.assistant():
        s += gen("answer", max_tokens=12)


def test_roles_render_the_models_chat_template(engine, engine_backend):
    state = chat.run(question="What colour is the sky?", temperature=0.0, backend=engine_backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[2]["content"] == state["answer"]
    assert state.text() == engine.tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = engine.tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    direct = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})
    assert state["answer"] == direct["text"]


@pytest.mark.parametrize("backend_name", ["engine_backend", "endpoint"])
def test_streaming_text_iter(backend_name, request):
    backend = request.getfixturevalue(backend_name)
    state = chat.run(question="Name a fruit.", temperature=0.0, max_new_tokens=16, stream=True, backend=backend)
    pieces = list(state.text_iter())
    answer_pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state.text()
    assert "".join(answer_pieces) == state["answer"]
    assert len(answer_pieces) >= 2  # the generation arrived in pieces, as decoded
    assert state.get_meta_info("answer")["completion_tokens"] >= 2


@function
def branches_gather(s):
    s += "List of animals:"
    forks = s.fork(2)
    forks += " a"
    for i, branch in enumerate(forks):
        branch += f" {'big' if i == 0 else 'small'}" + gen("animal", max_tokens=3)
    forks.join()
    s += "\nDone."


def test_fork_join_gathers_branch_variables(engine_backend):
    state = branches_gather.run(temperature=0.0, backend=engine_backend)
    assert isinstance(state["animal"], list) and len(state["animal"]) == 2
    assert state.text() == "List of animals:\nDone."
    # Each branch equals the same text run straight through.
    for i, animal in enumerate(state["animal"]):
        prompt = f"List of animals: a {'big' if i == 0 else 'small'}"
        assert animal == engine_backend.generate(prompt, {"max_new_tokens": 3, "temperature": 0.0})["text"]


@function
def two_steps(s, nucleus):
    s += "Count: one, two," + gen("first", max_tokens=2)
    s += gen("second", max_tokens=2, top_p=nucleus)


def test_errors_reach_the_caller_and_stay_in_their_program(engine_backend):
    with pytest.raises(ValueError, match="top_p"):
        two_steps.run(nucleus=2.0, backend=engine_backend)
    states = two_steps.run_batch([{"nucleus": 1.0}, {"nucleus": 2.0}], backend=engine_backend, temperature=0.0)
    assert states[0].error is None and states[0]["second"] is not None
    assert isinstance(states[1].error, ValueError)
    assert states[1]["first"] == states[0]["first"]  # what ran before the failure is kept
    with pytest.raises(ValueError):
        states[1].text()
    with pytest.raises(KeyError):
        states[0]["missing"]


# ---- structured generation (regex / json_schema pass through) ----------------------------------------

@function
def structured(s):
    s += "Is water wet? Answer yes or no: " + gen("yes_no", regex="(yes|no)", max_tokens=4)
    s += "\nA person as JSON: " + gen("person", json_schema={
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }, max_tokens=40)


def test_regex_and_json_schema_constrain_gen(engine_backend):
    state = structured.run(temperature=0.0, backend=engine_backend)
    assert re.fullmatch("(yes|no)", state["yes_no"])
    person = json.loads(state["person"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


# ---- the example scripts run against a server ---------------------------------------------------------

def load_example(name: str):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["dsl_fork_branches", "dsl_fewshot_select", "dsl_json_extraction",
                                  "dsl_sglang_script"])
def test_example_scripts_run_against_the_server(name, server, capsys):
    example = load_example(name)
    example.main(["--url", server.url, "--api-key", KEY_A])
    lines = capsys.readouterr().out.strip().splitlines()
    if name == "dsl_fork_branches":
        cached = [line for line in lines if "prompt tokens came from the cache" in line]
        assert len(cached) == 3 and all(not line.split("] ")[1].startswith("0 ") for line in cached)
        assert lines[-1].strip().startswith("summary:")
    elif name == "dsl_sglang_script":
        assert [line.split(":")[0] for line in lines[:3]] == ["tip 1", "tip 2", "tip 3"]
        cached = json.loads(lines[3].split(": ", 1)[1])
        assert len(cached) == 3 and all(tokens > 10 for tokens in cached)
        assert lines[4].startswith("answer:")
        record = json.loads(lines[5].split(": ", 1)[1])
        assert isinstance(record["name"], str) and isinstance(record["founded"], int)
    elif name == "dsl_fewshot_select":
        assert [line.split()[0] for line in lines] == ["negative", "positive", "negative", "positive", "negative"]
    else:
        people = [json.loads(line) for line in lines]
        assert len(people) == 2 and all(set(p) == {"name", "age", "city", "occupation"} for p in people)


def _character(s):
    s += "Construct a character within the following format:\n"
    s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
    s += "\nPlease generate new Name, Birthday and Job.\n"
    s += "Name:" + gen("name", stop="\n") + "\nBirthday:" + gen("birthday", stop="\n")
    s += "\nJob:" + gen("job", stop="\n") + "\n"


def test_api_speculative_execution_reads_later_gens_from_one_generation(engine_backend):
    """`@function(num_api_spec_tokens=N)` (SGLang's API speculative execution): greedy, the speculating program's
    variables equal the plain program's wherever the model wrote the program's own text, with fewer prompt tokens sent;
    where it wrote something else the gen made its own request."""
    plain, speculative = function(_character), function(num_api_spec_tokens=64)(_character)
    usage = engine_backend.token_usage
    usage.reset()
    expected = plain.run(backend=engine_backend, temperature=0, max_new_tokens=16)
    plain_prompt_tokens = usage.prompt_tokens
    assert plain_prompt_tokens > 0 and usage.completion_tokens > 0
    usage.reset()
    state = speculative.run(backend=engine_backend, temperature=0, max_new_tokens=16)
    assert usage.prompt_tokens < plain_prompt_tokens
    assert state.text() == expected.text()
    assert [state[n] for n in ("name", "birthday", "job")] == [expected[n] for n in ("name", "birthday", "job")]
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        function(num_api_spec_tokens=0)(_character)
