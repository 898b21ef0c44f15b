"""Hermes / Qwen 2.5 / Qwen 3 format: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from radixserve.runtime.http.openai.tool_parsers.base import (
    CallFrame,
    ParsedOutput,
    ToolCall,
    ToolParser,
    call_from_object,
    decode_json_prefix,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = OPEN
    call_frame = CallFrame(separator="\n", call_open=OPEN + "\n", call_close="\n" + CLOSE)

    def parse(self, text: str) -> ParsedOutput:
        calls, content, position = [], [], 0
        while True:
            start = text.find(OPEN, position)
            gap = text[position:] if start < 0 else text[position:start]
            if not calls or gap.strip():  # whitespace between and after calls is only layout
                content.append(gap)
            if start < 0:
                break
            body_start = start + len(OPEN)
            decoded = decode_json_prefix(text, body_start)
            call = call_from_object(decoded[0]) if decoded else None
            if decoded is None or call is None:  # malformed: the rest stays as it was written
                content.append(text[start:])
                break
            end = decoded[1]
            rest = text[end:]
            stripped = rest.lstrip()
            if stripped.startswith(CLOSE):
                end += len(rest) - len(stripped) + len(CLOSE)
            elif stripped:  # a call not closed before other text: not a call
                content.append(text[start:])
                break
            calls.append(call)
            position = end
        return ParsedOutput("".join(content), calls)

    def settled_calls(self, text: str) -> list[ToolCall]:
        """Closed calls stay calls whatever follows them."""
        end = text.rfind(CLOSE)
        return self.parse(text[:end + len(CLOSE)]).calls if end >= 0 else []

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"
                         for name, args in calls)


class Qwen25Parser(HermesParser):
    name = "qwen25"
