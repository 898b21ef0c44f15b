"""Pythonic format (Llama 3.2 / 4, Olmo): the output is a Python list of calls, `[get_weather(city="Paris"), f()]`,
optionally wrapped in `<|python_start|>` ... `<|python_end|>`. Argument values are Python literals; JSON's
`true`, `false` and `null` are accepted as well, as models write both."""

from __future__ import annotations

import ast
import json
from typing import Any

from radixserve.runtime.http.openai.tool_parsers.base import CallFrame, ParsedOutput, ToolCall, ToolParser

WRAP_OPEN, WRAP_CLOSE = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotACall(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise _NotACall("** in a dict")
        return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values)}  # type: ignore[arg-type]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError) as error:
        raise _NotACall(str(error)) from None


def _call(node: ast.AST) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall("not a call of a named function with keyword arguments")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise _NotACall("** in a call")
        arguments[keyword.arg] = _literal(keyword.value)
    return ToolCall(name=node.func.id, arguments=json.dumps(arguments, ensure_ascii=False))


class PythonicParser(ToolParser):
    name = "pythonic"
    start_marker = "["
    at_start_only = True
    tag_markers = (WRAP_OPEN,)
    arguments_key = None
    call_frame = CallFrame(separator=", ", calls_open="[", calls_close="]")

    def parse(self, text: str) -> ParsedOutput:
        start = self.call_start(text)
        if start >= len(text):
            return ParsedOutput(text, [])
        body = text[start:].strip()
        if body.startswith(WRAP_OPEN):
            body = body[len(WRAP_OPEN):].removesuffix(WRAP_CLOSE).strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise _NotACall("not a list of calls")
            calls = [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start], calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        def value(v: Any) -> str:
            return repr(v)

        written = [f"{name}({', '.join(f'{key}={value(v)}' for key, v in args.items())})" for name, args in calls]
        return "[" + ", ".join(written) + "]"
