"""What every tool-call parser shares: the parsed call, the parse result, and the parser interface.

A parser knows one model family's way of writing function calls in plain text (`<tool_call>{...}</tool_call>`,
`[TOOL_CALLS] [...]`, a bare JSON object, a Python call list). It turns a finished output into calls plus the
text left for `content`; a malformed call is never an exception: its text simply stays in `content`. It also
writes calls in its own format (for replaying an assistant's earlier calls to a template that cannot render
them, and for the grammar that constrains decoding), so parsing and writing are tested against each other.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from radixserve.runtime.http.openai.tool_parsers.partial import PartialCall, partial_calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call: `arguments` is JSON text of an object, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFrame:
    """How a format lays out its calls: `calls_open`, then each call as `call_open <call> call_close` with
    `separator` between calls, then `calls_close` (what the call grammar spells around each call)."""

    separator: str
    call_open: str = ""
    call_close: str = ""
    calls_open: str = ""
    calls_close: str = ""


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def call_from_object(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """A call from a decoded JSON value `{"name": str, "arguments"|"parameters": object}`, or None if it is not
    one (arguments given as JSON text inside a string are accepted too, as some models write them)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def decode_json_prefix(text: str, start: int = 0) -> Optional[tuple[Any, int]]:
    """The JSON value that starts at `text[start]` (after whitespace) and the index just past it, or None."""
    decoder = json.JSONDecoder()
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        return decoder.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


class ToolParser(ABC):
    """One model family's tool-call text format.

    `start_marker` opens the tool-call part of an output; text before it is content, and while streaming,
    text from it on is held back until the calls in it parse (or the output ends). `at_start_only` parsers
    recognise `start_marker` only at the very start of the output (after whitespace)."""

    name: ClassVar[str]
    start_marker: ClassVar[str]
    at_start_only: ClassVar[bool] = False
    # Special tags that open the tool-call part wherever they appear (e.g. Llama's `<|python_tag|>`).
    tag_markers: ClassVar[tuple[str, ...]] = ()
    # Special tokens that spell the format (e.g. `[TOOL_CALLS]`) must survive detokenization.
    needs_special_tokens: ClassVar[bool] = False
    # The key of a call's JSON object that holds its arguments (None: the format is not JSON).
    arguments_key: ClassVar[Optional[str]] = "arguments"
    call_frame: ClassVar[CallFrame]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Calls in a finished output, and the rest of the text as content; never raises on malformed text."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """`calls` (name, arguments) written the way the model writes them."""

    def settled_calls(self, text: str) -> list[ToolCall]:
        """The calls of an unfinished output that no continuation can take back (streamed before the end);
        by default none: in most formats text after a call can still make the whole output prose."""
        return []

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of an unfinished output whose name is out, with their arguments text so far (partial.py);
        [] for a format that is not JSON."""
        start = self.call_start(text)
        if self.arguments_key is None or start >= len(text):
            return []
        return partial_calls(text, start)

    def call_start(self, text: str) -> int:
        """Where the tool-call part of `text` starts (len(text) if nowhere yet)."""
        for marker in self.tag_markers:
            index = text.find(marker)
            if index >= 0:
                return index
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            return stripped if text[stripped:].startswith(self.start_marker) else len(text)
        index = text.find(self.start_marker)
        return len(text) if index < 0 else index

    def may_start_later(self, text: str) -> int:
        """How many trailing characters of `text` could still grow into a start marker (held back while
        streaming, so a marker split over two chunks is never shown as content)."""
        held = 0
        if self.at_start_only and self.start_marker.startswith(text.lstrip()):
            held = len(text)
        markers = self.tag_markers if self.at_start_only else (self.start_marker, *self.tag_markers)
        for marker in markers:
            for size in range(min(len(marker) - 1, len(text)), held, -1):
                if marker.startswith(text[-size:]):
                    held = size
                    break
        return held

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text describing `tools` (OpenAI function definitions) and this format, for models
        whose chat template does not render tools itself."""
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = self.format_calls([("function_name", {"argument": "value"})])
        return ("You can call functions. The available functions, as JSON schemas:\n"
                f"{listing}\n"
                f"To call a function, answer with exactly:\n{example}\n"
                "with the function's name and its arguments as a JSON object.")
