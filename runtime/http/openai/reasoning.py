"""`--reasoning-parser`: the model's thinking, written between `<think>` and `</think>`, split from its answer.

`qwen3`: thinking only when the output opens with `<think>` (Qwen 3 can be told not to think, through
`chat_template_kwargs: {"enable_thinking": false}`). `deepseek-r1`: the template already opened `<think>` in
the prompt, so the output starts inside the thinking (an opening tag written anyway is dropped), and an output
that never closes it is all thinking. A split is a pure function of the text so far; while streaming, a tail
that could still become a tag is held back, so every split extends the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


def _held_tail(text: str, marker: str) -> int:
    """Trailing characters of `text` that are a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    name: ClassVar[str] = "qwen3"
    starts_in_reasoning: ClassVar[bool] = False

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """(reasoning, content) of `text`; with `finished` False, a possible partial tag at the end is held back."""
        body = text.lstrip()
        if body.startswith(THINK_OPEN):
            body = body[len(THINK_OPEN):]
        elif not self.starts_in_reasoning:
            if not finished and THINK_OPEN.startswith(body):
                return ReasoningSplit("", "")  # may still open a think block
            return ReasoningSplit("", text)
        end = body.find(THINK_CLOSE)
        if end < 0:
            held = 0 if finished else _held_tail(body, THINK_CLOSE)
            return ReasoningSplit(body[:len(body) - held], "")
        return ReasoningSplit(body[:end], body[end + len(THINK_CLOSE):].lstrip())


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}") \
            from None
