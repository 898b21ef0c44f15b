"""Mistral format: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (`[TOOL_CALLS]` is a special token)."""

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

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    start_marker = MARKER
    needs_special_tokens = True
    call_frame = CallFrame(separator=", ", calls_open=MARKER + " [", calls_close="]")

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(MARKER)
        if start < 0:
            return ParsedOutput(text, [])
        decoded = decode_json_prefix(text, start + len(MARKER))
        if decoded is None:
            return ParsedOutput(text, [])
        value, end = decoded
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(item) for item in items]
        if not calls or any(call is None for call in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start] + text[end:], calls)  # type: ignore[arg-type]

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return MARKER + " " + json.dumps([{"name": name, "arguments": args} for name, args in calls],
                                         ensure_ascii=False)
