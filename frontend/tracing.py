"""Find the text every program of a batch begins with, before running any of them.

`run_batch` prefills that prefix once, so the programs, which start together, all find it in the radix
cache instead of each computing it. The prefix is found by running the program function once with a
tracing state and stand-ins for its arguments: it collects the constant text (strings, roles) and stops at
the first thing that depends on an argument or on the model (a gen, a select, reading a variable, a fork,
an image).
The traced text is built with the same Transcript and chat template as a real run, so it is exactly the
start of every program's text.

The function's own Python code runs during the trace (up to where it stops), so side effects before the
first argument-dependent statement happen once more.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from radixserve.frontend.chat_template import ChatTemplate
from radixserve.frontend.ir import Concat, Part, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, check_part
from radixserve.frontend.state import StateScopes
from radixserve.frontend.transcript import Transcript


class _StopTracing(Exception):
    """The program reached something that is not the same for every batch entry."""


def _stop(*args: Any, **kwargs: Any) -> Any:
    raise _StopTracing


class _Unknown:
    """Stands for a program argument: any use of it ends the constant prefix."""

    __str__ = __repr__ = __format__ = __bytes__ = _stop
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _stop
    __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = __call__ = _stop
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _stop
    __int__ = __float__ = __index__ = _stop

    def __getattr__(self, name: str) -> Any:
        raise _StopTracing


class TracingState(StateScopes):
    """A stand-in for ProgramState that records constant text and stops at anything else."""

    def __init__(self, template: Callable[[], ChatTemplate]):
        self.transcript = Transcript()
        self._template = template

    def __iadd__(self, other: Any) -> "TracingState":
        self._feed(check_part(other))
        return self

    def _feed(self, item: Part) -> None:
        if isinstance(item, str):
            self.transcript.append(item)
        elif isinstance(item, Concat):
            for part in item.parts:
                self._feed(part)
        elif isinstance(item, RoleBegin):
            self.transcript.begin_role(item.role, self._template())
        elif isinstance(item, RoleEnd):
            self.transcript.end_role(item.role, self._template())
        elif isinstance(item, (VarScopeBegin, VarScopeEnd)):
            pass  # appends no text
        else:
            raise _StopTracing

    # Everything that reads results or branches depends on the model.
    __getitem__ = get_var = set_var = get_meta_info = text = messages = text_iter = fork = sync = _stop


def constant_prefix(func: Callable[..., Any], arguments: list[str], bound: dict[str, Any],
                    template: Callable[[], ChatTemplate]) -> str:
    """The text `func(s, **kwargs)` appends before anything depending on `arguments` (the batch's keyword
    names) or on the model; `bound` holds arguments fixed for every program. "" when nothing is constant."""
    state = TracingState(template)
    stand_ins = {name: _Unknown() for name in arguments if name not in bound}
    try:
        inspect.signature(func).bind(state, **bound, **stand_ins)
    except TypeError:
        return ""  # the batch's arguments do not fit the function; the real run reports that
    try:
        func(state, **bound, **stand_ins)
    except _StopTracing:
        pass
    except Exception:  # noqa: BLE001 - code that tracing cannot follow; the prefix so far is still valid
        pass
    return state.transcript.text
