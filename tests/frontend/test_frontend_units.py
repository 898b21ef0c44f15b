"""The DSL's model-free parts: chat-template pieces, prefix tracing, choice scoring rules, sampling merge, API checks.

The chat-template tests use the embedded model's real tokenizer and check the piecewise rendering against
Hugging Face's `apply_chat_template` on whole conversations.
"""

from __future__ import annotations

import json

import pytest

from radixserve.frontend import (
    assistant,
    function,
    gen,
    greedy_token_selection,
    select,
    system,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
)
from radixserve.frontend.chat_template import ChatTemplate
from radixserve.frontend.choices import choice_span
from radixserve.frontend.ir import Concat, Gen, GenParams, RoleBegin, RoleEnd, Select, check_part
from radixserve.frontend.sampling import SamplingDefaults
from radixserve.frontend.tracing import constant_prefix
from radixserve.frontend.transcript import Transcript


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def build(template: ChatTemplate, messages: list[dict[str, str]]) -> Transcript:
    transcript = Transcript()
    for message in messages:
        transcript.begin_role(message["role"], template)
        transcript.append(message["content"])
        transcript.end_role(message["role"], template)
    return transcript


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "3"},
     {"role": "assistant", "content": "Four"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_piecewise_chat_equals_the_models_template(tokenizer, messages):
    template = ChatTemplate.from_tokenizer(tokenizer)
    transcript = build(template, messages)
    assert transcript.text == tokenizer.apply_chat_template(messages, tokenize=False)
    assert transcript.messages == messages


def test_first_user_message_gets_the_templates_default_system_prompt(tokenizer):
    template = ChatTemplate.from_tokenizer(tokenizer)
    assert "You are a helpful AI assistant named SmolLM" in template.prefix("user", first=True)
    assert "SmolLM" not in template.prefix("user", first=False)


# A template of another shape: a default system line, "### Role" headers, and a separator only between turns.
HEADER_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}SYSTEM: be helpful\n{% endif %}"
    "{% for m in messages %}### {{ m['role'] | capitalize }}\n{{ m['content'] | trim }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant\n{% endif %}"
)
# A template without a system role.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
)


def test_other_template_shapes(tokenizer):
    template = ChatTemplate.from_tokenizer(tokenizer, HEADER_TEMPLATE)
    for messages in CONVERSATIONS:
        rendered = tokenizer.apply_chat_template(messages, chat_template=HEADER_TEMPLATE, tokenize=False)
        assert build(template, messages).text == rendered

    template = ChatTemplate.from_tokenizer(tokenizer, NO_SYSTEM_TEMPLATE)
    messages = CONVERSATIONS[1]
    rendered = tokenizer.apply_chat_template(messages, chat_template=NO_SYSTEM_TEMPLATE, tokenize=False)
    assert build(template, messages).text == rendered
    with pytest.raises(ValueError, match="system"):
        build(template, [{"role": "system", "content": "x"}])


def test_roles_must_nest_properly(tokenizer):
    template = ChatTemplate.from_tokenizer(tokenizer)
    transcript = Transcript()
    transcript.begin_role("user", template)
    with pytest.raises(ValueError, match="inside an open user message"):
        transcript.begin_role("assistant", template)
    with pytest.raises(ValueError, match="assistant_end without"):
        transcript.end_role("assistant", template)


# ---- prefix tracing --------------------------------------------------------------------------------------

def trace(func, arguments, tokenizer, bound=None):
    template = ChatTemplate.from_tokenizer(tokenizer)
    return constant_prefix(func, arguments, bound or {}, lambda: template)


def test_tracing_stops_at_the_first_argument_or_model_dependency(tokenizer):
    def concat(s, review):
        s += "Few-shot examples.\n"
        s += "Review: " + review + "\nLabel:" + gen("label")

    def fstring(s, review):
        s += "Examples.\n" + "More.\n"
        s += f"Review: {review}"

    def model_first(s, review):
        s += "Intro: " + gen("x") + "\n"
        s += review

    def branches_on_argument(s, flag):
        s += "A"
        if flag:
            s += "B"

    assert trace(concat, ["review"], tokenizer) == "Few-shot examples.\n"
    assert trace(fstring, ["review"], tokenizer) == "Examples.\nMore.\n"
    assert trace(model_first, ["review"], tokenizer) == "Intro: "
    assert trace(branches_on_argument, ["flag"], tokenizer) == "A"


def test_tracing_renders_roles_and_uses_bound_arguments(tokenizer):
    def chat(s, persona, question):
        s += system("You are " + persona + ".")
        with s.user():
            s += "Question: " + question
        s += assistant(gen("answer"))

    template = ChatTemplate.from_tokenizer(tokenizer)
    expected = build(template, [{"role": "system", "content": "You are a pirate."}]).text
    # `"Question: " + question` fails while the expression is built, before `+=` sees its constant part.
    expected += template.prefix("user", first=False)
    assert trace(chat, ["question"], tokenizer, bound={"persona": "a pirate"}) == expected
    # Unbound persona: the system message itself depends on the batch.
    assert trace(chat, ["persona", "question"], tokenizer) == ""


def test_tracing_survives_programs_it_cannot_follow(tokenizer):
    def reads_results(s, x):
        s += "Start. "
        s += gen("a")
        s += s["a"] + x

    def raises(s, x):
        s += "Head. "
        raise RuntimeError("user bug")

    assert trace(reads_results, ["x"], tokenizer) == "Start. "
    assert trace(raises, ["x"], tokenizer) == "Head. "
    assert trace(raises, ["not_a_parameter"], tokenizer) == ""


# ---- choice scoring rules --------------------------------------------------------------------------------

def test_choice_span_rescores_a_merged_boundary_token():
    assert choice_span([1, 2, 3, 9], [1, 2, 3, 7, 8]) == 3
    assert choice_span([1, 2, 3], [1, 2, 3, 4]) == 3
    assert choice_span([], [5, 6]) == 1  # position 0 has no logprob


def test_scoring_methods():
    logprobs = [[-1.0, -3.0], [-0.5, -4.0, -0.5], [-2.0]]
    ids = [[10, 11], [10, 12, 13], [20]]
    scores = token_length_normalized.scores(logprobs, None, ids)
    assert scores == pytest.approx([-2.0, -5.0 / 3, -2.0])
    assert token_length_normalized.decide(scores, logprobs, ids) == 1
    # Ties go to the earlier choice.
    assert token_length_normalized.decide([-1.0, -1.0], logprobs[:2], ids[:2]) == 0

    unconditional = [[-2.0, -2.0], [-0.5, -1.0, -0.5], [-5.0]]
    scores = unconditional_likelihood_normalized.scores(logprobs, unconditional, ids)
    assert scores == pytest.approx([0.0, -1.0, 3.0])
    assert unconditional_likelihood_normalized.decide(scores, logprobs, ids) == 2


def test_greedy_token_selection_follows_shared_tokens():
    # Choices 0 and 1 start with the same token (same logprob); their second tokens decide.
    logprobs = [[-0.2, -3.0], [-0.2, -0.1], [-0.9]]
    ids = [[5, 6], [5, 7], [8]]
    scores = greedy_token_selection.scores(logprobs, None, ids)
    assert scores == [-0.2, -0.2, -0.9]
    assert greedy_token_selection.decide(scores, logprobs, ids) == 1
    # A choice that ends while still tied is what greedy decoding has produced in full.
    assert greedy_token_selection.decide(scores, [[-0.2], [-0.2, -0.1]], [[5], [5, 7]]) == 0
    # A better first token wins whatever follows.
    assert greedy_token_selection.decide(scores, [[-0.1, -9.0], [-0.2, -0.1]], [[4, 6], [5, 7]]) == 0


# ---- sampling defaults and the API -----------------------------------------------------------------------

def test_gen_settings_override_run_defaults():
    defaults = SamplingDefaults.make(temperature=0.0, max_new_tokens=64, stop="\n", top_k=None)
    params, options = defaults.resolve(GenParams(max_new_tokens=8, stop=("END",), return_logprob=True))
    assert params["temperature"] == 0.0 and params["max_new_tokens"] == 8 and params["stop"] == ["END"]
    assert params["top_k"] == -1
    assert "regex" not in params and "json_schema" not in params
    assert options == {"return_logprob": True, "logprob_start_len": None, "top_logprobs_num": None,
                       "return_text_in_logprobs": False}
    params, _ = defaults.resolve(GenParams(regex="[0-9]+"))
    assert params["regex"] == "[0-9]+" and params["stop"] == ["\n"] and params["max_new_tokens"] == 64


def test_api_builds_expressions_and_rejects_bad_ones():
    expr = "Q: " + gen("a", max_tokens=4, stop="\n") + "\n"
    assert isinstance(expr, Concat) and expr.parts[0] == "Q: " and expr.parts[2] == "\n"
    assert expr.parts[1] == Gen("a", GenParams(max_new_tokens=4, stop=("\n",)))
    assert user("hi").parts == (RoleBegin("user"), "hi", RoleEnd("user"))
    as_select = gen("pick", choices=["a", "b"])
    assert isinstance(as_select, Select) and as_select.choices == ("a", "b")
    assert as_select.method is token_length_normalized
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert json.loads(gen("j", json_schema=schema).params.json_schema) == schema
    with pytest.raises(ValueError):
        gen("x", regex="a", json_schema="{}")
    with pytest.raises(ValueError):
        select("x", [])
    with pytest.raises(ValueError):
        select("x", ["a", ""])
    with pytest.raises(TypeError):
        check_part(42)
    with pytest.raises(TypeError):
        "text" + gen("x") + 3  # noqa: B018

    @function
    def program(s, question):
        s += question

    assert program.func.__name__ == "program" and program.bind(question="q").bound == {"question": "q"}
    with pytest.raises(TypeError):
        function(lambda: None)
    with pytest.raises(TypeError, match="batch_kwargs"):
        program.run_batch([{"question": "q"}], question="q")


def test_speculation_cuts_gens_at_their_stops_and_follows_the_programs_text():
    from radixserve.frontend.speculative import Speculation

    spec = Speculation(32)
    assert spec.take(["\n"]) is None  # nothing speculated yet
    spec.fill(" Ada.\nBirthday: May 1.\nJob: poet", {"finish_reason": {"type": "length"}})
    assert spec.take(["\n"]) == " Ada."
    spec.follow("\nBirthday:")
    assert spec.take(["\n", "."]) == " May 1"  # the first stop string that occurs
    spec.follow(".\nJob:")
    assert spec.take(["\n"]) is None and spec.pending == ""  # cut at the token limit: the gen asks for itself
    spec.fill(" Ada.\nAge: 3", {"finish_reason": {"type": "stop", "matched": 2}})
    assert spec.take(["\n"]) == " Ada."
    spec.follow("\nBirthday:")  # the model wrote something else: speculation ends
    assert spec.pending == "" and spec.take(["\n"]) is None
    spec.fill(" poet", {"finish_reason": {"type": "stop", "matched": 2}})
    assert spec.take(["\n"]) == " poet"  # the model ended its text there: the whole rest is the value
    assert not Speculation.eligible({"regex": "[0-9]+"}, {}, False)
    assert not Speculation.eligible({}, {"return_logprob": True}, False)
    assert not Speculation.eligible({}, {}, True) and Speculation.eligible({"stop": ["\n"]}, {}, False)
