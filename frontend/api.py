"""The DSL's public functions (SGLang's frontend names, so an SGLang script only changes its import).

    from radixserve.frontend import function, gen, select, system, user, assistant, set_default_backend, RuntimeEndpoint

    @function
    def qa(s, question):
        s += system("You are a concise assistant.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=64, stop="\\n"))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is a radix tree?", temperature=0)["answer"])
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence, Union

from radixserve.frontend.backends.default import get_default_backend, set_default_backend
from radixserve.frontend.choices import ChoicesMethod, token_length_normalized
from radixserve.frontend.ir import Expr, Gen, GenParams, RoleBegin, RoleEnd, Select, role_expr
from radixserve.frontend.program import Program
from radixserve.frontend.sampling import as_tuple


def function(func: Optional[Callable[..., Any]] = None) -> Any:
    """Make a program of `func(s, ...)`; use as `@function` or `@function()`."""
    if func is None:
        return Program
    return Program(func)


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
    stop_token_ids: Union[int, Sequence[int], None] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    regex: Optional[str] = None,
    json_schema: Union[str, dict, None] = None,
    choices: Optional[Sequence[str]] = None,
    choices_method: Optional[ChoicesMethod] = None,
) -> Expr:
    """Generate text here, store it in variable `name` (if given) and append it to the program's text.

    Arguments left None take the run's defaults (`f.run(temperature=0, max_new_tokens=64)`). `regex` or
    `json_schema` (a JSON Schema dict or string) constrain the output. With `choices`, this is
    `select(name, choices, choices_method)`.
    """
    if choices is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen takes either choices or a regex/json_schema constraint, not both")
        return select(name, choices, choices_method or token_length_normalized)
    if regex is not None and json_schema is not None:
        raise ValueError("gen takes at most one of regex and json_schema")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    params = GenParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        stop=None if stop is None else as_tuple(stop),
        stop_token_ids=None if stop_token_ids is None else as_tuple(stop_token_ids),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, params)


def select(name: Optional[str] = None, choices: Optional[Sequence[str]] = None,
           choices_method: ChoicesMethod = token_length_normalized) -> Expr:
    """Append the choice the model scores highest after the text so far, and store it in variable `name`.

    All choices are scored in one batched request; `s.get_meta_info(name)` has the scores (see choices.py
    for the methods: token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized).
    """
    if not choices or not all(isinstance(choice, str) and choice for choice in choices):
        raise ValueError("select needs a non-empty list of non-empty strings as choices")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"choices_method must be a ChoicesMethod, got {type(choices_method).__name__}")
    return Select(name, tuple(choices), choices_method)


def system(expr: Any = None) -> Expr:
    """A system message around `expr` (text and/or gen/select expressions)."""
    return role_expr("system", expr)


def user(expr: Any = None) -> Expr:
    """A user message around `expr`."""
    return role_expr("user", expr)


def assistant(expr: Any = None) -> Expr:
    """An assistant message around `expr` (typically a gen)."""
    return role_expr("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


__all__ = [
    "function", "gen", "select", "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
]
