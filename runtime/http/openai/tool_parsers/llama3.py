"""Llama 3.1 / 3.2 JSON format: the output is `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`; several calls are separated by `;`."""

from __future__ import annotations

import json
from typing import Any

from radixserve.runtime.http.openai.tool_parsers.base import (
    CallFrame,
    ParsedOutput,
    ToolParser,
    call_from_object,
    decode_json_prefix,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolParser):
    name = "llama3"
    start_marker = "{"
    at_start_only = True
    tag_markers = (PYTHON_TAG,)
    arguments_key = "parameters"
    call_frame = CallFrame(separator="; ")

    def parse(self, text: str) -> ParsedOutput:
        start = self.call_start(text)
        if start >= len(text):
            return ParsedOutput(text, [])
        position = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls = []
        while True:
            decoded = decode_json_prefix(text, position)
            call = call_from_object(decoded[0], ("parameters", "arguments")) if decoded else None
            if call is None:
                break
            calls.append(call)
            position = decoded[1]
            rest = text[position:].lstrip()
            if not rest.startswith(";"):
                break
            position = len(text) - len(rest) + 1
        if not calls or text[position:].strip():  # anything but calls after the tag: not a call output
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start], calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls)
