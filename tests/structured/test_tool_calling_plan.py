"""How a chat request with tools is planned, on the embedded model's real tokenizer and chat template (which
does not render tools): the tools and call format go into the system message, earlier calls are written back
in the parser's format, "required" / named choices carry the call grammar, and every misuse is a 400."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from radixserve.runtime.http.state import InflightRequests, ServerState
from radixserve.runtime.model_files import default_model_path, load_tokenizer
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, parse_request
from radixserve.runtime.http.openai.tool_calling import plan_chat_output, split_output
from radixserve.runtime.tenancy import TenantResolver
from radixserve.runtime.wire.server_args import ServerArgs

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _state(tokenizer, **args) -> ServerState:
    return ServerState(engine=None, server_args=ServerArgs(**args), tenants=TenantResolver(),
                       inflight=InflightRequests(None), tokenizer=tokenizer, served_model_name="m", model_info=None,
                       context_len=2048, vocab_size=len(tokenizer), max_total_tokens=None)


def _body(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": HISTORY, "tools": [WEATHER], **fields}).encode())


def _bad(state, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        plan_chat_output(state, _body(**fields))
    assert info.value.status_code == 400
    return info.value


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    plan = plan_chat_output(_state(tokenizer, tool_call_parser="hermes"), _body())
    assert "tools" not in plan.template_kwargs and plan.tool_parser is not None
    assert grammar_accepts(plan.body.ebnf, "Let me look.") and not grammar_accepts(plan.body.ebnf, "<tool_call>{}")
    rendered = tokenizer.apply_chat_template(plan.conversation, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "get_weather"' in rendered and "<tool_call>" in rendered
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           '</tool_call><|im_end|>' in rendered
    assert '<|im_start|>tool\n{"celsius": 3}<|im_end|>' in rendered


def test_a_template_with_tools_receives_them(tokenizer):
    template = ("{% for tool in tools %}TOOL {{ tool.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
                "{% endfor %}\n{% endfor %}")
    state = _state(tokenizer, tool_call_parser="hermes", chat_template=template)
    plan = plan_chat_output(state, _body(chat_template_kwargs={"enable_thinking": False}))
    assert plan.template_kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert plan.template_kwargs["enable_thinking"] is False
    assert plan.conversation[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("parser,parallel", [("hermes", True), ("llama3", False), ("mistral", True),
                                             ("pythonic", False)])
def test_required_and_named_choices_carry_the_call_grammar(tokenizer, parser, parallel):
    state = _state(tokenizer, tool_call_parser=parser)
    plan = plan_chat_output(state, _body(tool_choice="required", parallel_tool_calls=parallel))
    call = plan.tool_parser.format_calls([("get_weather", {"city": "Bergen"})])
    assert grammar_accepts(plan.body.ebnf, call)
    assert not grammar_accepts(plan.body.ebnf, plan.tool_parser.format_calls([("get_weather", {"town": "Bergen"})]))
    named = plan_chat_output(state, _body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert grammar_accepts(named.body.ebnf, call)
    assert split_output(plan, call).tool_calls[0].name == "get_weather"
    if parser == "mistral":
        assert plan.body.skip_special_tokens is False
    auto = plan_chat_output(state, _body(tool_choice="auto", parallel_tool_calls=parallel))
    assert grammar_accepts(auto.body.ebnf, call) and grammar_accepts(auto.body.ebnf, "It is sunny.")
    assert not grammar_accepts(auto.body.ebnf, plan.tool_parser.format_calls([("get_weather", {"town": "Bergen"})]))
    two = plan.tool_parser.format_calls([("get_weather", {"city": "Bergen"})] * 2)
    assert grammar_accepts(plan.body.ebnf, two) == parallel and grammar_accepts(auto.body.ebnf, two) == parallel
    assert not grammar_accepts(named.body.ebnf, two)
    # "auto" with the request's own grammar: that grammar applies, not the call grammar
    own = plan_chat_output(state, _body(tool_choice="auto", regex="[a-z]+"))
    assert own.body.ebnf is None and own.body.regex == "[a-z]+"
    text = plan_chat_output(state, _body(tool_choice="required", parallel_tool_calls=parallel,
                                         response_format={"type": "text"}))
    assert text.body.ebnf == plan.body.ebnf  # a "text" response_format constrains nothing


def test_misuse_is_a_400(tokenizer):
    assert _bad(_state(tokenizer)).param == "tools"  # no parser to describe or read calls
    state = _state(tokenizer, tool_call_parser="hermes")
    assert _bad(state, tool_choice="required", regex="a+").param == "tool_choice"
    assert _bad(state, chat_template_kwargs={"tools": []}).param == "chat_template_kwargs"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    assert _bad(state, tools=[bad_tool], tool_choice="required").param == "tools"  # compiled: checked strictly
    broken = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
                                                         "function": {"name": "f", "arguments": "[1]"}}]}]
    assert _bad(state, messages=broken).param == "messages[1].tool_calls"


def test_reasoning_is_split_unless_the_request_keeps_it(tokenizer):
    state = _state(tokenizer, reasoning_parser="deepseek-r1")
    text = "First, 2+2.</think>\n4"
    plain = parse_request(ChatCompletionRequest, json.dumps({"messages": HISTORY[:1]}).encode())
    out = split_output(plan_chat_output(state, plain), text)
    assert (out.reasoning_content, out.content) == ("First, 2+2.", "4")
    kept = plain.model_copy(update={"separate_reasoning": False})
    out = split_output(plan_chat_output(state, kept), text)
    assert (out.reasoning_content, out.content) == (None, text)
