"""Tool-call parsers by `--tool-call-parser` name (SGLang's names)."""

from __future__ import annotations

from radixserve.runtime.http.openai.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from radixserve.runtime.http.openai.tool_parsers.hermes import HermesParser, Qwen25Parser
from radixserve.runtime.http.openai.tool_parsers.llama3 import Llama3Parser
from radixserve.runtime.http.openai.tool_parsers.mistral import MistralParser
from radixserve.runtime.http.openai.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Qwen25Parser, Llama3Parser, MistralParser, PythonicParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; expected one of {', '.join(PARSERS)}") from None


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolParser", "get_tool_parser"]
