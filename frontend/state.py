"""The state `s` a program appends to, and the group of branches `s.fork(n)` returns.

    s += "Question: " + question + "\\n"           # queue text and expressions (does not wait)
    s += "Answer:" + gen("answer", max_tokens=32)
    with s.user():                                 # the same as s += user_begin() ... s += user_end()
        s += "Thanks!"
    s["answer"]; s.text(); s.messages()           # wait for the results they depend on
    forks = s.fork(3)                              # branches sharing the text so far
    for f in forks: f += gen("idea", max_tokens=16)
    forks.join()                                   # s["idea"] == [branch 0's, branch 1's, branch 2's]

Reading from a failed program raises its first error.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from radixserve.frontend.executor import ProgramExecutor
from radixserve.frontend.ir import RoleBegin, RoleEnd, SetVariables, check_part

JOIN_MODES = ("gather_variable", "concate_and_append")


class RoleScopes:
    """`with s.system(): ...`, `with s.user(): ...`, `with s.assistant(): ...`: a message around the block."""

    def __iadd__(self, other: Any) -> Any:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self) -> contextlib.AbstractContextManager:
        return self._role_scope("system")

    def user(self) -> contextlib.AbstractContextManager:
        return self._role_scope("user")

    def assistant(self) -> contextlib.AbstractContextManager:
        return self._role_scope("assistant")


class ProgramState(RoleScopes):
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
        """Set a variable in program order (after what is already queued)."""
        self._executor.submit(SetVariables(((name, value),)))

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

    def __repr__(self) -> str:
        # No waiting and no raising here: the text as far as it has run.
        return f"ProgramState(text={self._executor.transcript.text!r})"


class ProgramStateGroup:
    """The branches of a fork: index or iterate them; `+=` appends to every branch; `join` reports back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        for state in self.states:
            state += other
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
