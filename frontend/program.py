"""`Program`: what `@function` makes of a program function, with `run` and `run_batch`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional, Union

from radixserve.frontend.backends.default import resolve_backend
from radixserve.frontend.interpreter import run_program, run_program_batch
from radixserve.frontend.sampling import SamplingDefaults
from radixserve.frontend.state import ProgramState

# Keyword arguments of run / run_batch that set the program's sampling defaults rather than its arguments.
SAMPLING_KEYWORDS = frozenset(f.name for f in dataclasses.fields(SamplingDefaults))


def _split_defaults(kwargs: dict[str, Any]) -> tuple[SamplingDefaults, dict[str, Any]]:
    sampling = {name: kwargs.pop(name) for name in list(kwargs) if name in SAMPLING_KEYWORDS}
    return SamplingDefaults.make(**sampling), kwargs


class Program:
    """A DSL program: a function whose first parameter is the program state `s`."""

    def __init__(self, func: Callable[..., Any], bound: Union[dict[str, Any], None] = None,
                 num_api_spec_tokens: Optional[int] = None):
        if not inspect.signature(func).parameters:
            raise TypeError(f"a program function takes the state as its first parameter: {func.__name__}(s, ...)")
        if num_api_spec_tokens is not None and (not isinstance(num_api_spec_tokens, int) or num_api_spec_tokens < 1):
            raise ValueError(f"num_api_spec_tokens must be a positive int, got {num_api_spec_tokens!r}")
        self.func = func
        self.bound = dict(bound or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> "Program":
        """A copy with some arguments fixed for every run."""
        return Program(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once and return its state.

        Keyword arguments named like SamplingDefaults fields (max_new_tokens, temperature, top_p, top_k,
        min_p, stop, stop_token_ids, frequency_penalty, presence_penalty, ignore_eos, return_logprob, ...)
        are the defaults of every gen in the program; the others are the program's own arguments.
        stream=True returns at once; follow the output with `state.text_iter()`. Raises the program's
        first error (without stream).
        """
        defaults, program_kwargs = _split_defaults(dict(kwargs))
        return run_program(self.func, args, {**self.bound, **program_kwargs}, resolve_backend(backend), defaults,
                           stream, self.num_api_spec_tokens)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: Union[int, str] = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:
        """Run the program once per dict of keyword arguments, concurrently on `num_threads` threads
        ("auto": one per program, at most 64), after prefilling the prefix they all share once.

        `sampling`: SamplingDefaults fields, as in `run`. Returns the states in batch order; a failed
        program's state has `.error` set (reading its results raises it).
        """
        unknown = set(sampling) - SAMPLING_KEYWORDS
        if unknown:
            raise TypeError(f"run_batch got unknown keyword(s) {sorted(unknown)}; program arguments go in "
                            f"batch_kwargs")
        if not all(isinstance(kwargs, dict) for kwargs in batch_kwargs):
            raise TypeError("batch_kwargs must be a list of dicts of keyword arguments")
        return run_program_batch(self.func, list(batch_kwargs), self.bound, resolve_backend(backend),
                                 SamplingDefaults.make(**sampling), num_threads, progress_bar,
                                 self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        """The same as `run`."""
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Program({self.func.__qualname__})"
