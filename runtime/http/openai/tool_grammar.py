"""The grammar that makes a model's tool calls always parse: EBNF for the parser's call format, with each call's
arguments constrained by the tools' parameter schemas.

One call is, in the JSON formats, the object `{"name": <one of the allowed names>, <arguments key>: <that tool's
arguments>}`, whose JSON schema (an `anyOf` over the allowed tools) xgrammar turns into EBNF; in the pythonic
format it is `name(key=value, ...)` (python_call_grammar.py). The parser's `CallFrame` lays the calls out
(`<tool_call>\\n ... \\n</tool_call>`, `[TOOL_CALLS] [..., ...]`, ...): one call, or with parallel calls one to
`MAX_PARALLEL_CALLS`, and nothing after them, so the end of the output follows the last call.

- `tool_choice` "required" or a named function: the output is exactly the calls.
- "auto": the output is free text or calls. For a format whose calls may follow text (hermes, mistral), it is
  text that never contains the start marker, then optionally the calls; for a format whose calls are the
  whole output (llama3, pythonic), either the calls, or text whose first non-blank character cannot start a
  call (and that holds no call tag). With a reasoning parser, a `<think>` block may come first. This part is an
  xgrammar structural tag (free text with excluded strings), printed as EBNF.

The result goes to the scheduler as the request's `ebnf` sampling parameter, so it is compiled, cached and
enforced exactly like a user's grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from radixserve.runtime.http.openai.protocol_tools import Tool, ToolSchemaError
from radixserve.runtime.http.openai.python_call_grammar import ebnf_string, embed_grammar, python_calls_grammar
from radixserve.runtime.http.openai.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser
from radixserve.runtime.http.openai.tool_parsers import ToolParser
from radixserve.runtime.wire.grammar_check import check_grammar, grammar_error_message

# A bound on the calls of one output: a small model asked for parallel calls tends to repeat its call until
# max_tokens; the grammar ends the output after this many instead.
MAX_PARALLEL_CALLS = 8
_BLANKS = r"[ \t\r\n]*"

__all__ = ["MAX_PARALLEL_CALLS", "ToolSchemaError", "call_schema", "check_tool_schemas", "schema_problem",
           "tool_call_grammar", "with_loose_schemas"]


def call_schema(tools: list[Tool], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call's object, for any of `tools`."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: tool.function.parameters_schema()},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for tool in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def schema_problem(tool: Tool) -> Optional[str]:
    """Why xgrammar cannot compile `tool`'s parameters into a grammar, or None when it can."""
    schema = tool.function.parameters_schema()
    if schema.get("type", "object") != "object":
        return f"must describe an object, got type {schema.get('type')!r}"
    try:
        check_grammar("json_schema", json.dumps(schema))
    except ValueError as error:
        return str(error)
    return None


def check_tool_schemas(tools: list[Tool], where: Optional[list[str]] = None) -> None:
    """Raise ToolSchemaError naming the first tool whose parameters xgrammar cannot compile."""
    where = where or [f"tools[{i}].function.parameters" for i in range(len(tools))]
    for tool, name in zip(tools, where):
        problem = schema_problem(tool)
        if problem is not None:
            raise ToolSchemaError(f"{name} {problem}" if problem.startswith("must ") else f"{name}: {problem}")


def with_loose_schemas(tools: list[Tool]) -> list[Tool]:
    """`tools`, each whose parameters cannot be compiled taking any JSON object as its arguments instead. For
    "auto", where the schemas only shape the calls a model may make: SGLang and vLLM pass such a schema (say
    `{"type": "int"}`, not JSON Schema's "integer") to the template without checking it."""
    loose = {"type": "object"}
    return [tool if schema_problem(tool) is None else
            tool.model_copy(update={"function": tool.function.model_copy(update={"parameters": loose})})
            for tool in tools]


def _one_call_grammar(parser: ToolParser, tools: list[Tool], where: list[str]) -> str:
    """EBNF whose root is one call of any of `tools`, as `parser`'s format writes the call itself."""
    import xgrammar

    if parser.arguments_key is None:
        return python_calls_grammar([(tool.function.name, tool.function.parameters_schema()) for tool in tools],
                                    where)
    try:
        call = xgrammar.Grammar.from_json_schema(json.dumps(call_schema(tools, parser.arguments_key)),
                                                 any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ToolSchemaError(grammar_error_message("tools", error)) from None
    return str(call)


def calls_grammar(parser: ToolParser, tools: list[Tool], parallel: bool, where: Optional[list[str]] = None) -> str:
    """EBNF that accepts exactly one call of `tools` in `parser`'s format, or with `parallel` one to
    MAX_PARALLEL_CALLS of them."""
    where = where or [f"tools[{i}].function.parameters" for i in range(len(tools))]
    call_root, rules = embed_grammar(_one_call_grammar(parser, tools, where), "call_")
    frame = parser.call_frame
    one = " ".join(part for part in (ebnf_string(frame.call_open) if frame.call_open else "", call_root,
                                     ebnf_string(frame.call_close) if frame.call_close else "") if part)
    calls = f"{one} ({ebnf_string(frame.separator)} {one}){{0, {MAX_PARALLEL_CALLS - 1}}}" if parallel else one
    if frame.calls_open or frame.calls_close:
        calls = f"{ebnf_string(frame.calls_open)} {calls} {ebnf_string(frame.calls_close)}"
    return "\n".join([f"root ::= {calls}"] + [f"{name} ::= {body}" for name, body in rules.items()])


def _auto_format(parser: ToolParser, calls: str, reasoning: Optional[ReasoningParser]) -> Any:
    """The structural tag of "auto": free text or `calls` (EBNF), after an optional think block."""
    from xgrammar.structural_tag import (AnyTextFormat, ConstStringFormat, GrammarFormat, OptionalFormat, OrFormat,
                                         RegexFormat, SequenceFormat)

    call_part = GrammarFormat(grammar=calls)
    if parser.at_start_only:
        cannot_start = "".join(sorted({re.escape(marker[0]) for marker in (parser.start_marker, *parser.tag_markers)}))
        prose = SequenceFormat(elements=[RegexFormat(pattern=f"{_BLANKS}[^ \\t\\r\\n{cannot_start}]"),
                                         AnyTextFormat(excludes=list(parser.tag_markers))])
        body: Any = OptionalFormat(content=OrFormat(elements=[call_part, prose]))
    else:
        prose = AnyTextFormat(excludes=[parser.start_marker, *parser.tag_markers])
        body = SequenceFormat(elements=[prose, OptionalFormat(content=call_part)])
    if reasoning is None or not parser.at_start_only:  # free text before the calls already holds a think block
        return body
    opening = [] if reasoning.starts_in_reasoning else [ConstStringFormat(value=THINK_OPEN)]
    thinking = SequenceFormat(elements=[*opening, AnyTextFormat(excludes=[THINK_CLOSE]),
                                        ConstStringFormat(value=THINK_CLOSE), RegexFormat(pattern=_BLANKS)])
    return SequenceFormat(elements=[OptionalFormat(content=thinking), body])


def tool_call_grammar(parser: ToolParser, tools: list[Tool], *, parallel: bool, auto: bool = False,
                      reasoning: Optional[ReasoningParser] = None, where: Optional[list[str]] = None) -> str:
    """The `ebnf` of a request: exactly the calls of `tools` (required or named), or with `auto` free text or
    the calls. `where` names each tool in error messages (default `tools[i]`)."""
    import xgrammar
    from xgrammar.structural_tag import StructuralTag

    ebnf = calls_grammar(parser, tools, parallel, where)
    if auto:
        ebnf = str(xgrammar.Grammar.from_structural_tag(StructuralTag(format=_auto_format(parser, ebnf, reasoning))))
    check_grammar("ebnf", ebnf)  # a framing or renaming mistake is a server bug: fail loudly, never garble
    return ebnf
