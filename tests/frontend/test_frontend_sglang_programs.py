"""SGLang's frontend test programs, written again for radixserve in the same shapes, on both backends.

Each program runs on the in-process Engine backend and on a RuntimeEndpoint against a real server (the session's
shared one), written as an SGLang script would (`import radixserve as sgl`). The checks are about API behaviour
(types, choices, constraints, variables, fork/join, streaming), not about the quality of the answers of a 135M
model; generations are kept to a few tokens, as the suite runs on two CPU cores.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import radixserve as sgl
from http_fixtures import KEY_A, shared_server
from radixserve.frontend import (REGEX_FLOAT, REGEX_INT, REGEX_STR, EngineBackend, ModalityNotSupportedError,
                                 RuntimeEndpoint)
from radixserve.runtime.engine import Engine

BACKENDS = ["engine_backend", "endpoint"]


@pytest.fixture(scope="module")
def engine_backend():
    with Engine(log_level="warning") as engine:
        yield EngineBackend(engine)


@pytest.fixture(scope="module")
def endpoint():
    with RuntimeEndpoint(shared_server("main").url, api_key=KEY_A) as backend:
        yield backend


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each test runs once per backend, with that backend as the default (as an SGLang script sets it)."""
    backend = request.getfixturevalue(request.param)
    sgl.set_default_backend(backend)
    yield backend
    sgl.set_default_backend(None)


# ---- few-shot QA ---------------------------------------------------------------------------------------

@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=6, temperature=0)


def test_few_shot_qa(backend):
    state = few_shot_qa.run(question="What is the capital of the United States?")
    assert isinstance(state["answer"], str) and "\n" not in state["answer"]
    assert state.text().endswith("A:" + state["answer"])
    questions = ["What is the capital of Japan?", "What is the capital of the United Kingdom?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0.1)
    assert len(states) == 2
    for one, question in zip(states, questions):
        assert one.error is None and one.text().endswith(f"Q: {question}\nA:" + one["answer"])
    # The gen's temperature=0 wins over the batch's 0.1: the same question gives the same answer as alone.
    alone = few_shot_qa.run(question=questions[0])
    assert states[0]["answer"] == alone["answer"]


# ---- mt-bench: roles and multi-turn chat ---------------------------------------------------------------

@sgl.function
def answer_mt_bench(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1"))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2")


def test_mt_bench(backend):
    state = answer_mt_bench.run(question_1="Describe a trip to Hawaii.", question_2="Now in one sentence.",
                                temperature=0.7, max_new_tokens=6)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"][:len(messages)]
    assert len(messages) == 5
    assert messages[2]["content"] == state["answer_1"] and messages[4]["content"] == state["answer_2"]
    assert state.text() == backend.tokenizer.apply_chat_template(messages, tokenize=False)


# ---- select ------------------------------------------------------------------------------------------

CHOICES = ["True", "False", "Unknown"]


@sgl.function
def true_or_false(s, statement, as_gen=False):
    s += "Determine whether the statement below is True, False, or Unknown.\n"
    s += "Statement: The capital of France is Paris.\nAnswer: True\n"
    s += "Statement: " + statement + "\n"
    if as_gen:  # SGLang's other spelling of a select
        s += "Answer:" + sgl.gen("answer", choices=CHOICES)
    else:
        s += "Answer:" + sgl.select("answer", CHOICES)


def test_select(backend):
    for statement in ("The capital of Germany is Berlin.", "Purple is a better color than green."):
        state = true_or_false.run(statement=statement)
        assert true_or_false.run(statement=statement, as_gen=True)["answer"] == state["answer"]
        assert state["answer"] in CHOICES
        assert state.text().endswith("Answer:" + state["answer"])
        meta = state.get_meta_info("answer")
        # SGLang's keys: the mean prompt logprob per choice, and [logprob, token_id, text] per scored token.
        assert len(meta["normalized_prompt_logprobs"]) == 3
        assert meta["output_token_logprobs"] == [[], [], []]
        for i, (choice, entries) in enumerate(zip(CHOICES, meta["input_token_logprobs"])):
            assert all(isinstance(lp, float) and lp <= 0 and isinstance(tid, int) for lp, tid, _ in entries)
            assert "".join(text for _, _, text in entries).endswith(choice)
            mean = sum(lp for lp, _, _ in entries) / len(entries)
            assert meta["normalized_prompt_logprobs"][i] == pytest.approx(mean)
        best = max(range(3), key=lambda i: (meta["normalized_prompt_logprobs"][i], -i))
        assert state["answer"] == CHOICES[best]


# ---- decode int / json: gen_int, gen_string, dtype, var_scope ------------------------------------------

@sgl.function
def decode_int(s):
    s += "The number of hours in a day is " + sgl.gen_int("hours") + "\n"
    s += "The number of days in a year is " + sgl.gen_int("days") + "\n"


def test_decode_int(backend):
    state = decode_int.run(temperature=0.1, max_new_tokens=6)
    for name in ("hours", "days"):
        assert re.fullmatch(r"[+-]?[0-9]+", state[name]), state[name]
        int(state[name])
    assert state.text() == (f"The number of hours in a day is {state['hours']}\n"
                            f"The number of days in a year is {state['days']}\n")


@sgl.function
def decode_json_regex(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    s += "Here is the JSON object:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen(regex=REGEX_STR, max_tokens=8) + ",\n"
        s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
        s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
        s += "}"


@sgl.function
def decode_json(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string(max_tokens=8) + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
        s += '  "timezone": ' + sgl.gen(dtype=str, max_tokens=8) + "\n"
        s += "}"


@pytest.mark.parametrize("program", [decode_json_regex, decode_json], ids=["regex", "dtype"])
def test_decode_json(backend, program):
    state = program.run(temperature=0.0, max_new_tokens=6)
    text = state["json_output"]
    assert text.startswith("{\n") and text.endswith("}") and state.text().endswith(text)
    value = json.loads(text)
    assert isinstance(value["name"], str) and isinstance(value["population"], int)
    if program is decode_json:
        assert isinstance(value["area"], int) and isinstance(value["timezone"], str)
    else:
        assert isinstance(value["latitude"], (int, float))


@sgl.function
def dtype_gen(s):
    s += "Q: What is the full name of DNS?\n"
    s += "A: The full name is " + sgl.gen("str_res", dtype=str, stop="\n", max_tokens=12) + "\n"
    s += "Q: Which year was DNS invented?\n"
    s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
    s += "Q: What is the value of pi?\n"
    s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
    s += "Q: Is the sky blue?\n"
    s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"


def test_dtype_gen(backend):
    state = dtype_gen.run(temperature=0.0, max_new_tokens=6)
    assert re.fullmatch(REGEX_STR, state["str_res"]) and isinstance(json.loads(state["str_res"]), str)
    assert state["bool_res"] in ("True", "False")
    # After the run, results convert in place (`state[name] = ...`, as SGLang's test does).
    state["int_res"] = int(state["int_res"])
    state["float_res"] = float(state["float_res"])
    state["bool_res"] = state["bool_res"] == "True"
    assert isinstance(state["int_res"], int) and isinstance(state["float_res"], float)
    assert isinstance(state["bool_res"], bool)


# ---- expert answer: a variable read while the program is being built ---------------------------------

@sgl.function
def expert_answer(s, question):
    s += "Question: " + question + "\n"
    s += "A good person to answer this question is" + sgl.gen("expert", stop=[".", "\n"]) + ".\n"
    s += "For example," + s["expert"] + " would answer that " + sgl.gen("answer", stop=".") + "."


def test_expert_answer(backend):
    state = expert_answer.run(question="What is the capital of France?", temperature=0.1, max_new_tokens=5)
    expert, answer = state["expert"], state["answer"]
    assert "." not in expert and "\n" not in expert and "." not in answer
    assert state.text().endswith(f"is{expert}.\nFor example,{expert} would answer that {answer}.")


# ---- tool use: a Python function between two model calls -------------------------------------------

def calculate(expression: str) -> str:
    left, operator, right = re.fullmatch(r"([0-9]+) ?([*+-]) ?([0-9]+)", expression).groups()
    left, right = int(left), int(right)
    return str({"*": left * right, "+": left + right, "-": left - right}[operator])


@sgl.function
def tool_use(s, lhs, rhs):
    s += "Please perform computations using a calculator. You can use calculate(expression) to get the results.\n"
    s += "For example,\ncalculate(1+2)=3\ncalculate(3*4)=12\n"
    s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
    # The expression is constrained to what the calculator takes: this checks the plumbing, not arithmetic.
    s += "Answer: The answer is calculate(" + sgl.gen("expression", regex=r"[0-9]{1,4} ?[*+-] ?[0-9]{1,4}",
                                                      stop=")") + ") = "
    with s.var_scope("answer"):
        s += calculate(s["expression"])


def test_tool_use(backend):
    state = tool_use(lhs=257, rhs=983, temperature=0, max_new_tokens=12)
    assert state["answer"] == calculate(state["expression"])
    assert state.text().endswith(f"calculate({state['expression']}) = {state['answer']}")


# ---- ReAct: control flow on the model's choices ------------------------------------------------------

@sgl.function
def react(s, question):
    s += """
Question: Which country does the founder of Microsoft live in?
Thought 1: I need to search for the founder of Microsoft.
Action 1: Search [Founder of Microsoft].
Observation 1: The founder of Microsoft is Bill Gates.
Thought 2: I need to search for the country where Bill Gates lives in.
Action 2: Search [Where does Bill Gates live].
Observation 2: Bill Gates lives in the United States.
Thought 3: The answer is the United States.
Action 3: Finish [United States].

"""
    s += "Question: " + question + "\n"
    for i in range(1, 3):
        s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
        s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
        if s[f"action_{i}"] == "Search":
            s += " [" + sgl.gen(stop="]") + "].\n"
            s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
        else:
            s += " [" + sgl.gen("answer", stop="]") + "].\n"
            break


def test_react(backend):
    state = react.run(question="What country does the creator of Linux live in?", temperature=0.1,
                      max_new_tokens=3)
    actions = [state[f"action_{i}"] for i in (1, 2) if f"action_{i}" in state]
    assert actions and all(action in ("Search", "Finish") for action in actions)
    assert ("Finish" in actions) == ("answer" in state)
    for i, action in enumerate(actions, start=1):
        assert f"Action {i}: {action} [" in state.text()
    if "Finish" in actions:
        assert state.text().endswith(f" [{state['answer']}].\n") and actions.index("Finish") == len(actions) - 1


# ---- parallel decoding: forks[i] += ... ----------------------------------------------------------------

FORK_SIZE = 3


@sgl.function
def parallel_decoding(s, topic):
    s += "Act as a helpful assistant.\n"
    s += "USER: Give some tips for " + topic + ".\n"
    s += "ASSISTANT: Okay. Here are " + str(FORK_SIZE) + " concise tips, each under 8 words:\n"
    for i in range(1, 1 + FORK_SIZE):  # the skeleton
        s += f"{i}." + sgl.gen(max_tokens=3, stop=[".", "\n"]) + ".\n"
    forks = s.fork(FORK_SIZE)
    for i in range(FORK_SIZE):  # each tip in detail, in parallel
        forks[i] += f"Now, I expand tip {i + 1} into a detailed paragraph:\nTip {i + 1}:"
        forks[i] += sgl.gen("detailed_tip", 4, stop=["\n\n"])
    forks.join()
    s += "Here are these tips with detailed explanation:\n"
    for i in range(FORK_SIZE):
        s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=3)
    s.set_var("branches", list(forks))


def test_parallel_decoding(backend):
    state = parallel_decoding.run(topic="writing a good blog post", temperature=0.3)
    tips, branches = state["detailed_tip"], state["branches"]
    assert isinstance(tips, list) and len(tips) == FORK_SIZE and all(isinstance(tip, str) for tip in tips)
    assert isinstance(state["summary"], str)
    text = state.text()
    fork_point = text.index("Here are these tips")
    for i, (tip, branch) in enumerate(zip(tips, branches)):
        assert branch["detailed_tip"] == tip
        assert branch.text() == text[:fork_point] + f"Now, I expand tip {i + 1} into a detailed paragraph:\n" \
                                                    f"Tip {i + 1}:" + tip
        assert f"Tip {i + 1}:{tip}\n" in text[fork_point:]
        # The fork prefilled the shared text once: each branch found (almost) all of it in the radix cache.
        meta = branch.get_meta_info("detailed_tip")
        shared = len(backend.encode(text[:fork_point]))
        assert meta["cached_tokens"] >= shared - 2, (meta, shared)


@sgl.function
def replace_a_branch(s):
    forks = s.fork(2)
    forks[0] = forks[1]


def test_fork_branches_cannot_be_replaced(backend):
    with pytest.raises(TypeError, match="cannot be replaced"):
        replace_a_branch.run()


# ---- parallel encoding: forks += lambda i: ... ---------------------------------------------------------

@sgl.function
def parallel_encoding(s, question, context_0, context_1, context_2):
    s += "USER: I will ask a question based on some statements.\n"
    s += "ASSISTANT: Sure. I will give the answer.\n"
    s += "USER: Please memorize these statements.\n"
    contexts = [context_0, context_1, context_2]
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Now, please answer the following question. Do not list options."
    s += "\nQuestion: " + question + "\n"
    s += "ASSISTANT:" + sgl.gen("answer", max_tokens=6)


def test_parallel_encoding(backend):
    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]
    state = parallel_encoding.run(question="Who is the father of Julian?", context_0=contexts[0],
                                  context_1=contexts[1], context_2=contexts[2], temperature=0)
    statements = "".join(f"Statement {i}: {context}\n" for i, context in enumerate(contexts))
    assert ("USER: Please memorize these statements.\n" + statements + "Now, please answer") in state.text()
    assert state.text().endswith("ASSISTANT:" + state["answer"])
    assert state.get_meta_info("answer")["completion_tokens"] <= 6


# ---- streaming, with logprobs --------------------------------------------------------------------------

@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True, top_logprobs_num=2))


def test_stream_with_logprobs(backend):
    question = "Compose a travel blog post about Hawaii."
    expected = qa.run(question=question, temperature=0, max_new_tokens=6)

    state = qa.run(question=question, temperature=0, max_new_tokens=6, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"] == expected["answer"]
    assert "".join(state.text_iter()) == state.text() == expected.text()
    meta = state.get_meta_info("answer")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(meta["output_top_logprobs"])
    assert [entry[1] for entry in meta["output_token_logprobs"]] == \
        [entry[1] for entry in expected.get_meta_info("answer")["output_token_logprobs"]]

    async def read() -> list:
        streamed = qa.run(question=question, temperature=0, max_new_tokens=6, stream=True)
        return [piece async for piece in streamed.text_async_iter("answer", return_meta_data=True)]

    pieces_with_meta = asyncio.run(read())
    assert "".join(text for text, _ in pieces_with_meta) == expected["answer"]
    # Each piece carries the logprobs of the tokens since the previous one: together, every token once.
    entries = [entry for _, piece_meta in pieces_with_meta for entry in piece_meta["output_token_logprobs"]]
    assert 1 <= len(entries) <= meta["completion_tokens"]
    assert [entry[1] for entry in entries] == [entry[1] for entry in meta["output_token_logprobs"]][:len(entries)]


# ---- regex, min tokens ---------------------------------------------------------------------------------

IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@sgl.function
def regex_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen("answer", temperature=0, regex=IP_REGEX)


def test_regex(backend):
    state = regex_gen.run(max_new_tokens=16)
    assert re.fullmatch(IP_REGEX, state["answer"]), state["answer"]


MIN_TOKENS, MAX_TOKENS = 8, 10


@sgl.function
def convo(s, min_tokens):
    s += sgl.user("Is the sky blue? Answer yes or no.")
    s += sgl.assistant(sgl.gen("answer", min_tokens=min_tokens, max_tokens=MAX_TOKENS))


def test_gen_min_tokens(backend):
    free = convo.run(min_tokens=None, temperature=0).get_meta_info("answer")
    assert free["completion_tokens"] < MIN_TOKENS  # the short answer this check relies on
    state = convo.run(min_tokens=MIN_TOKENS, temperature=0)
    assert MIN_TOKENS <= state.get_meta_info("answer")["completion_tokens"] <= MAX_TOKENS


# ---- separate_reasoning, image -------------------------------------------------------------------------

@sgl.function
def reasoning(s):
    s += sgl.user("What is 2 + 2? Think first.")
    # A regex makes the small model write a reasoning model's shape: <think>...</think> answer.
    s += sgl.assistant(sgl.separate_reasoning(
        sgl.gen("answer", regex=r"<think>[a-z]{2,6}</think> [0-9]", max_tokens=32),
        model_type="qwen3"))


def test_separate_reasoning(backend):
    state = reasoning.run(temperature=0)
    assert re.fullmatch(r"[0-9]", state["answer"])
    assert re.fullmatch(r"[a-z]{2,6}", state["answer_reasoning_content"])
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}
    assert state.text() == backend.tokenizer.apply_chat_template(state.messages(), tokenize=False)


def test_image_is_refused_clearly(backend):
    @sgl.function
    def image_qa(s, question):
        s += sgl.user(sgl.image("example_image.png") + question)
        s += sgl.assistant(sgl.gen("answer"))

    with pytest.raises(ModalityNotSupportedError, match="image input is not supported by this model"):
        image_qa.run(question="Describe this image.", max_new_tokens=4)
