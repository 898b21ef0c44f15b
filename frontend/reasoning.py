"""`separate_reasoning`: split a reasoning model's thinking from its answer (SGLang's model_type names).

Reasoning models write their thinking between tags before the answer: `<think>...</think> answer`. Some
(DeepSeek-R1, Qwen3 thinking models) have the opening tag in their chat template's generation prompt, so the
output starts inside the thinking and only the closing tag appears ("forced" below).

Splitting: when the output is in thinking (the opening tag is there, or the model's thinking is forced), the
reasoning is the text up to the closing tag and the answer is what follows it; without a closing tag the
whole output is reasoning (cut off by max_tokens) and the answer is empty. Otherwise the whole output is the
answer. Both parts are stripped of surrounding whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # the output begins inside the thinking even without the opening tag


_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, forced=True),
    "deepseek-v3": ReasoningFormat(*_THINK, forced=False),
    "qwen3": ReasoningFormat(*_THINK, forced=False),
    "qwen3-thinking": ReasoningFormat(*_THINK, forced=True),
    "glm45": ReasoningFormat(*_THINK, forced=False),
    "step3": ReasoningFormat(*_THINK, forced=True),
    "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", forced=False),
}


def reasoning_format(model_type: str) -> ReasoningFormat:
    """The format of `model_type`; ValueError naming the supported ones otherwise."""
    try:
        return REASONING_FORMATS[model_type]
    except KeyError:
        raise ValueError(f"unknown reasoning model_type {model_type!r}; choose from "
                         f"{sorted(REASONING_FORMATS)}") from None


def split_reasoning(text: str, model_type: str) -> tuple[str, str]:
    """(reasoning, answer) of a generated `text` (see the module docstring)."""
    fmt = reasoning_format(model_type)
    before, opened, after = text.partition(fmt.start)
    if opened:
        text = before + after  # the opening tag is not part of either side
    elif not fmt.forced:
        return "", text.strip()
    reasoning, closed, answer = text.partition(fmt.end)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), answer.strip()


def reasoning_variable(name: str) -> str:
    """The variable that receives the reasoning of variable `name` (SGLang's naming)."""
    return f"{name}_reasoning_content"
