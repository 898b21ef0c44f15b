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
import warnings
from typing import Any, Callable, Optional, Sequence, Union

from radixserve.frontend.backends.default import as_backend, get_default_backend, set_default_backend
from radixserve.frontend.choices import ChoicesMethod, token_length_normalized
from radixserve.frontend.dtypes import dtype_name
from radixserve.frontend.ir import (Concat, Expr, Gen, GenParams, Media, RoleBegin, RoleEnd, Select,
                                    SeparateReasoning, role_expr)
from radixserve.frontend.program import Program
from radixserve.frontend.reasoning import reasoning_format
from radixserve.frontend.sampling import as_tuple


def function(func: Optional[Callable[..., Any]] = None, num_api_spec_tokens: Optional[int] = None) -> Any:
    """Make a program of `func(s, ...)`; use as `@function`, `@function()` or `@function(num_api_spec_tokens=N)`
    (API speculative execution: later gens read from one longer generation while the program's text matches it;
    see speculative.py)."""
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens=num_api_spec_tokens)
    return Program(func, num_api_spec_tokens=num_api_spec_tokens)


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
    stop_token_ids: Union[int, Sequence[int], None] = None,
    stop_regex: Union[str, Sequence[str], None] = None,
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
    dtype: Union[type, str, None] = None,
    choices: Optional[Sequence[str]] = None,
    choices_method: Optional[ChoicesMethod] = None,
    regex: Optional[str] = None,
    json_schema: Union[str, dict, None] = None,
) -> Expr:
    """Generate text here, store it in variable `name` (if given) and append it to the program's text.

    Arguments left None take the run's defaults (`f.run(temperature=0, max_new_tokens=64)`). `regex` or
    `json_schema` (a JSON Schema dict or string) constrain the output; `dtype` (int, float, bool or str, or
    their names) constrains it to a value of that type (see dtypes.py). With `choices`, this is
    `select(name, choices, temperature, choices_method)`. `n` (several samples) and `stop_regex` are SGLang
    arguments radixserve does not implement: values other than None (or n=1) raise ValueError.
    """
    if n not in (None, 1):
        raise ValueError(f"gen(n={n!r}) is not supported: run the gen in n fork branches instead")
    if stop_regex is not None:
        raise ValueError("gen(stop_regex=...) is not supported by radixserve; use stop strings or a regex constraint")
    if choices is not None:
        if regex is not None or json_schema is not None or dtype is not None:
            raise ValueError("gen takes either choices or a regex/json_schema/dtype constraint, not both")
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None and json_schema is not None:
        raise ValueError("gen takes at most one of regex and json_schema")
    dtype = dtype_name(dtype)
    if dtype is not None and (regex is not None or json_schema is not None):
        warnings.warn(f"gen has both dtype={dtype} and a regex/json_schema constraint; only the dtype is used",
                      stacklevel=2)
        regex = json_schema = None
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
        dtype=dtype,
    )
    return Gen(name, params)


def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
            **kwargs: Any) -> Expr:
    """`gen(..., dtype=int)`: an integer (parse it with `int(s[name])`). Takes gen's sampling arguments."""
    _check_typed_gen_kwargs("gen_int", kwargs)
    return gen(name, max_tokens, min_tokens, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
               **kwargs: Any) -> Expr:
    """`gen(..., dtype=str)`: a double-quoted string, a valid JSON string (`json.loads(s[name])`)."""
    _check_typed_gen_kwargs("gen_string", kwargs)
    return gen(name, max_tokens, min_tokens, dtype=str, **kwargs)


_TYPED_GEN_EXCLUDED = ("dtype", "regex", "json_schema", "choices", "choices_method")


def _check_typed_gen_kwargs(function_name: str, kwargs: dict[str, Any]) -> None:
    refused = [name for name in _TYPED_GEN_EXCLUDED if name in kwargs]
    if refused:
        raise TypeError(f"{function_name}() got unexpected keyword argument(s) {refused}: its constraint is its type")


def select(name: Optional[str] = None, choices: Optional[Sequence[str]] = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> Expr:
    """Append the choice the model scores highest after the text so far, and store it in variable `name`.

    All choices are scored in one batched request; `s.get_meta_info(name)` has the scores (see choices.py
    for the methods: token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized).
    Scoring is deterministic: a temperature above 0 raises ValueError (as SGLang's runtime backend refuses it).
    """
    if not choices or not all(isinstance(choice, str) and choice for choice in choices):
        raise ValueError("select needs a non-empty list of non-empty strings as choices")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"choices_method must be a ChoicesMethod, got {type(choices_method).__name__}")
    if temperature is None or temperature > 1e-5:
        raise ValueError(f"select scores its choices deterministically; temperature must be 0, got {temperature}")
    return Select(name, tuple(choices), choices_method)


def separate_reasoning(expr: Any = None, model_type: Optional[str] = None) -> Expr:
    """`expr` (one or more named gens), then split each gen's output into its answer (kept in the variable
    and in the program's text) and its reasoning (in variable `<name>_reasoning_content`). `model_type`:
    the reasoning format, one of reasoning.REASONING_FORMATS ("deepseek-r1", "qwen3", ...)."""
    if model_type is None:
        raise ValueError("separate_reasoning needs a model_type, e.g. model_type=\"deepseek-r1\"")
    reasoning_format(model_type)
    names = _generated_names(expr)
    if not names:
        raise ValueError("separate_reasoning needs an expression with a named gen, e.g. gen(\"answer\")")
    return Concat.of(expr, SeparateReasoning(tuple(names), model_type))


def _generated_names(expr: Any) -> list[str]:
    if isinstance(expr, (Gen, Select)):
        if not expr.name:
            raise ValueError("separate_reasoning needs its gen to have a name")
        return [expr.name]
    if isinstance(expr, Concat):
        return [name for part in expr.parts for name in _generated_names(part)]
    return []


def image(path: str) -> Expr:
    """An image input. radixserve serves text-only models: running it raises ModalityNotSupportedError."""
    return Media("image", str(path))


def video(path: str, num_frames: int) -> Expr:
    """A video input. radixserve serves text-only models: running it raises ModalityNotSupportedError."""
    return Media("video", str(path), int(num_frames))


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


def flush_cache(backend: Any = None) -> bool:
    """Drop the radix cache of `backend` (default: the default backend); False when there is no backend or
    the server refused (requests running)."""
    backend = backend if backend is not None else get_default_backend()
    if backend is None:
        return False
    return as_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> Optional[dict[str, Any]]:
    """The server statistics of `backend` (default: the default backend); None when there is no backend."""
    backend = backend if backend is not None else get_default_backend()
    if backend is None:
        return None
    return as_backend(backend).get_server_info()


__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning", "image", "video",
    "flush_cache", "get_server_info", "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
]
