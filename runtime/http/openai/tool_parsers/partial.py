"""The calls of an output still being generated, as far as they go: for streaming a call before it is complete.

In the JSON formats every call is an object that starts `{"name": "<name>", "arguments": ` (or "parameters"),
whatever frames it (`<tool_call>`, `[TOOL_CALLS] [...]`, nothing). Once that head is out, the name is known and
the arguments text grows token by token: a stream sends the name at once and each new piece of the arguments as
it comes, as SGLang does, so a call cut off by max_tokens still reaches the client as a (partial) call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_CLOSING = {"{": "}", "[": "]"}


@dataclass
class PartialCall:
    name: str
    arguments: str  # the arguments object's JSON text as written so far (all of it once `complete`)
    complete: bool


def json_value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON object, array or string that starts at `text[start]`; None while it is
    unfinished (or when no such value starts there)."""
    if start >= len(text) or text[start] not in '{["':
        return None
    expected: list[str] = []
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if not expected:
                    return index + 1
        elif char == '"':
            in_string = True
        elif char in _CLOSING:
            expected.append(_CLOSING[char])
        elif expected and char == expected[-1]:
            expected.pop()
            if not expected:
                return index + 1
    return None


def partial_calls(text: str, start: int) -> list[PartialCall]:
    """The calls of `text` from `start` (where its call part begins) whose head is out, in order; the last may be
    incomplete. Scanning stops at a call whose arguments are unfinished."""
    calls: list[PartialCall] = []
    position = start
    while True:
        head = _CALL_HEAD.search(text, position)
        if head is None:
            return calls
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            return calls
        if text[head.end():head.end() + 1] != "{":  # not yet, or not an object (JSON text in a string): the
            return calls                                # call goes out once it parses
        end = json_value_end(text, head.end())
        if end is None:
            calls.append(PartialCall(name, text[head.end():].rstrip(), complete=False))
            return calls
        calls.append(PartialCall(name, text[head.end():end], complete=True))
        position = end
