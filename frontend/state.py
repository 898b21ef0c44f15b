"""The state `s` a program appends to, and the group of branches `s.fork(n)` returns.

    s += "Question: " + question + "\\n"           # queue text and expressions (does not wait)
    s += "Answer:" + gen("answer", max_tokens=32)
    with s.user():                                 # the same as s += user_begin() ... s += user_end()
        s += "Thanks!"
    s["answer"]; s.text(); s.messages()           # wait for the results they depend on
    with s.var_scope("json"):                      # s["json"]: the text appended inside the block
        s += "{" + gen_int("n") + "}"
    forks = s.fork(3)                              # branches sharing the text so far
    forks += lambda i: f"Idea {i + 1}:"            # per-branch text (or forks[i] += ..., or a list)
    for f in forks: f += gen("idea", max_tokens=16)
    forks.join()                                   # s["idea"] == [branch 0's, branch 1's, branch 2's]

Reading from a failed program raises its first error.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator, Optional, Union

from radixserve.frontend.executor import ProgramExecutor
from radixserve.frontend.ir import (Expr, RoleBegin, RoleEnd, SetVariables, VarScopeBegin, VarScopeEnd, check_part,
                                    role_expr)

JOIN_MODES = ("gather_variable", "concate_and_append")


class StateScopes:
    """What both the program state and the prefix tracer offer: role messages, `s.user(expr)` or
    `with s.user(): ...` (also system, assistant), and `with s.var_scope(name): ...`."""

    def __iadd__(self, other: Any) -> Any:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._role_scope(role)
        message = role_expr(role, expr)
        self += message
        return message

    def system(self, expr: Any = None) -> Any:
        """With `expr`: append a system message around it. Without: a context manager around a block."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Variable `name` becomes the text appended inside the block (constants and generations alike)."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)


class ProgramState(StateScopes):
    """What a program function gets as `s`, and what `run` returns."""

    def __init__(self, executor: ProgramExecutor):
        self._executor = executor

    def __iadd__(self, other: Any) -> "ProgramState":
        self._executor.submit(check_part(other))
        return self

    # ---- results ---------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_variable(name)

    def get_var(self, name: str) -> Any:
        return self._executor.get_variable(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable in program order (after what is already queued); on the state `run` returned, once
        the program has finished (`state["n"] = int(state["n"])`)."""
        if self._executor.ended:
            self._executor.set_after_end(name, value)
        else:
            self._executor.submit(SetVariables(((name, value),)))

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.variables

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """The backend's meta_info of the gen that set `name` (prompt/cached/completion tokens, finish
        reason, logprobs), or a select's scores (choices.ChoiceScores fields)."""
        self._executor.get_variable(name)
        return self._executor.meta_info.get(name, {})

    def text(self) -> str:
        """The whole text so far (waits for everything queued)."""
        self.sync()
        return self._executor.transcript.text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages so far, as {"role", "content"} dicts (waits for everything queued)."""
        self.sync()
        return [dict(message) for message in self._executor.transcript.messages]

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Text as it is produced, until the program ends: everything, or only variable `var_name`'s.
        With `run(stream=True)` generations arrive in pieces as the model decodes."""
        return self._executor.iter_text(var_name)

    async def text_async_iter(self, var_name: Optional[str] = None,
                              return_meta_data: bool = False) -> AsyncIterator[Union[str, tuple[str, Any]]]:
        """`text_iter` for async code (the waiting runs on the loop's default executor). With
        return_meta_data, yields (text, meta_info): a generated piece's meta_info has the output logprobs of
        the tokens since the previous piece; a constant text's is None."""
        loop = asyncio.get_running_loop()
        pieces = self._executor.iter_text_with_meta(var_name)
        done = object()
        while True:
            piece = await loop.run_in_executor(None, next, pieces, done)
            if piece is done:
                return
            yield piece if return_meta_data else piece[0]

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that stopped the program, or None (waits for everything queued)."""
        self._executor.wait_all()
        return self._executor.error

    def sync(self) -> None:
        """Wait for everything queued; raise the program's error, if any."""
        self._executor.sync()
        self._executor.raise_if_failed()

    # ---- branches --------------------------------------------------------------------------------

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        """`size` branch states, each starting with this state's text, roles and variables. Waits for what
        is queued; with size > 1 the shared text is prefilled into the radix cache once, before any branch
        runs."""
        return ProgramStateGroup([ProgramState(child) for child in self._executor.fork(size)], self)

    @contextlib.contextmanager
    def copy(self) -> Iterator["ProgramState"]:
        """`with s.copy() as c: c += ...`: one branch, joined back (its variables gathered) after the block."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def __repr__(self) -> str:
        # No waiting and no raising here: the text as far as it has run.
        return f"ProgramState(text={self._executor.transcript.text!r})"


class ProgramStateGroup:
    """The branches of a fork: index or iterate them; `forks[i] += x` appends to branch i; `forks += x`
    appends x to every branch, `forks += lambda i: ...` each branch its own expression, and `forks += [x0,
    x1, ...]` one item per branch; `join` reports back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __setitem__(self, index: int, value: Any) -> None:
        # `forks[i] += x` appends to the branch, then stores it back in place: the same state.
        if value is not self.states[index]:
            raise TypeError("fork branches cannot be replaced; append to one with forks[i] += ...")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if isinstance(other, (str, Expr)):
            items = [other] * len(self.states)
        elif callable(other):
            items = [other(i) for i in range(len(self.states))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"forks += a list needs one item per branch ({len(self.states)}), got {len(other)}")
            items = list(other)
        else:
            raise TypeError(f"forks += takes text, an expression, a function of the branch index, or a list of "
                            f"them, not {type(other).__name__}")
        for state, item in zip(self.states, items):
            state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch, then, in the parent's program order:
        - "gather_variable": each variable the branches set becomes a list in the parent (one per branch);
        - "concate_and_append": the branches' own texts, concatenated, are appended to the parent.
        Raises the first branch error."""
        if mode not in JOIN_MODES:
            raise ValueError(f"unknown join mode {mode!r}; choose from {JOIN_MODES}")
        executors = [state._executor for state in self.states]
        for executor in executors:
            executor.sync()
            executor.raise_if_failed()
        if mode == "gather_variable":
            names: list[str] = []
            for executor in executors:
                names += [name for name in executor.assigned if name not in names]
            values = tuple((name, [executor.variables.get(name) for executor in executors]) for name in names)
            self.parent += SetVariables(values)
        else:
            self.parent += "".join(executor.transcript.text[executor.fork_point:] for executor in executors)
