"""The expressions a program appends to its state with `s += ...`, besides plain strings.

Expressions are immutable values made by the API functions (`gen`, `select`, the roles) and chained with `+`:

    s += "Q: " + gen("answer", max_tokens=16) + "\n"

is one `Concat` of three parts. An executor interprets them in order against a backend; the prefix tracer
interprets only their constant parts. Nothing here talks to a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every expression; `+` with a string or another expression makes a `Concat`."""

    def __add__(self, other: Any) -> "Concat":
        return Concat.of(self, other)

    def __radd__(self, other: Any) -> "Concat":
        return Concat.of(other, self)


Part = Union[str, Expr]


def check_part(value: Any) -> Part:
    """`value` if a program may append it (a str or an expression), else TypeError naming what it got."""
    if isinstance(value, (str, Expr)):
        return value
    raise TypeError(f"a program can append strings and gen/select/role expressions, not {type(value).__name__} "
                    f"(convert it with str() first)")


@dataclass(frozen=True)
class Concat(Expr):
    """Parts run one after the other; a part may use the text the previous parts appended."""

    parts: tuple[Part, ...]

    @staticmethod
    def of(*items: Any) -> "Concat":
        parts: list[Part] = []
        for item in items:
            if isinstance(item, Concat):
                parts.extend(item.parts)
            else:
                parts.append(check_part(item))
        return Concat(tuple(parts))


@dataclass(frozen=True)
class GenParams:
    """Per-call sampling settings of `gen`; None means "the program run's default" (see SamplingDefaults)."""

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    stop: Optional[tuple[str, ...]] = None
    stop_token_ids: Optional[tuple[int, ...]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[str] = None  # "int", "float", "str" or "bool": a regex constraint (see dtypes.py)


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text after everything appended so far; store it in variable `name` (if given) and append it."""

    name: Optional[str]
    params: GenParams


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Append whichever of `choices` the model scores highest (by `method`, a choices.ChoicesMethod) and store
    it in variable `name`. Compared by identity: the method object need not be comparable."""

    name: Optional[str]
    choices: tuple[str, ...]
    method: Any


@dataclass(frozen=True)
class RoleBegin(Expr):
    """Open a chat message of `role`: appends the chat template's prefix for it."""

    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    """Close the open chat message of `role`: appends the template's suffix and records the message."""

    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    """Start capturing text into variable `name` (`with s.var_scope(name):`); appends nothing."""

    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    """Set variable `name` to the text appended since its VarScopeBegin."""

    name: str


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """Split the reasoning out of the generated variables `names` (see reasoning.py): each keeps the answer,
    `<name>_reasoning_content` gets the reasoning, and the program text keeps only the answer."""

    names: tuple[str, ...]
    model_type: str


@dataclass(frozen=True)
class Media(Expr):
    """An image or video input (`image(path)`, `video(path, num_frames)`)."""

    kind: str
    path: str
    num_frames: Optional[int] = None


@dataclass(frozen=True)
class SetVariables(Expr):
    """Set program variables without appending text (how `fork(...).join()` and `s.set_var` report back)."""

    values: tuple[tuple[str, Any], ...]


def role_expr(role: str, body: Any = None) -> Expr:
    """`RoleBegin + body + RoleEnd`, or the bare pair when body is None (an empty message)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose from {ROLES}")
    if body is None:
        return Concat((RoleBegin(role), RoleEnd(role)))
    return Concat.of(RoleBegin(role), body, RoleEnd(role))
