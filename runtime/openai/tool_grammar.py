"""The grammar that makes a requested tool call always parse: EBNF for the parser's call format, with each
call's JSON object constrained by the tools' parameter schemas.

One call is the JSON object `{"name": <one of the allowed names>, <arguments key>: <that tool's arguments>}`;
xgrammar turns the JSON schema of that object (an `anyOf` over the allowed tools) into EBNF, whose root rule
is renamed here to `tool_call` so the parser's frame (`<tool_call>\\n ... \\n</tool_call>`, `[TOOL_CALLS] [...]`,
...) can wrap it as the new root. The result goes to the scheduler as the request's `ebnf` sampling parameter,
so it is compiled, cached and enforced exactly like a user's grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional

from radixserve.runtime.openai.protocol_tools import Tool
from radixserve.runtime.openai.tool_parsers import ToolParser
from radixserve.runtime.wire.grammar_check import check_grammar, grammar_error_message

CALL_RULE = "tool_call"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ToolSchemaError(ValueError):
    """A tool's parameters are not a JSON schema the grammar engine accepts (the message names the tool)."""


def _rename_rule(ebnf: str, old: str, new: str) -> str:
    """`ebnf` with every reference to rule `old` (outside string literals and character classes) renamed."""
    out: list[str] = []
    i = 0
    while i < len(ebnf):
        char = ebnf[i]
        if char in "\"[":
            close = '"' if char == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
            continue
        match = _IDENTIFIER.match(ebnf, i)
        if match and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
            word = match.group(0)
            out.append(new if word == old else word)
            i = match.end()
            continue
        out.append(char)
        i += 1
    return "".join(out)


def call_schema(tools: Iterable[Tool], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call's object, for any of `tools`."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: tool.function.parameters_schema()},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for tool in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def check_tool_schemas(tools: list[Tool]) -> None:
    """Raise ToolSchemaError naming the first tool whose parameters xgrammar cannot compile."""
    for index, tool in enumerate(tools):
        schema = tool.function.parameters_schema()
        if schema.get("type", "object") != "object":
            raise ToolSchemaError(f"tools[{index}].function.parameters must describe an object, got type "
                                  f"{schema.get('type')!r}")
        try:
            check_grammar("json_schema", json.dumps(schema))
        except ValueError as error:
            raise ToolSchemaError(f"tools[{index}].function.parameters: {error}") from None


def tool_call_grammar(parser: ToolParser, tools: list[Tool], parallel: bool) -> Optional[str]:
    """EBNF that accepts exactly well-formed calls of `tools` in `parser`'s format (one, or one or more with
    `parallel`); None when the format is not one a grammar is built for (pythonic)."""
    import xgrammar

    if parser.arguments_key is None:
        return None
    frame = parser.grammar_root(CALL_RULE, parallel)
    if frame is None:
        return None
    try:
        call = xgrammar.Grammar.from_json_schema(json.dumps(call_schema(tools, parser.arguments_key)),
                                                 any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ToolSchemaError(grammar_error_message("tools", error)) from None
    ebnf = f"root ::= {frame}\n" + _rename_rule(str(call), "root", CALL_RULE)
    check_grammar("ebnf", ebnf)  # a frame or renaming mistake is a server bug: fail loudly, never garble
    return ebnf
