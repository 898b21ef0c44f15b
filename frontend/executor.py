"""Executes one program's expressions, in order, against a backend, on a worker thread.

`s += expr` only queues `expr`, so a program's Python code runs ahead of the model: the branches of a fork,
and the programs of a batch, each have their own executor, and their requests reach the scheduler together
and batch there. Reading a result (`s["name"]`, `s.text()`) waits for what it depends on.

Contracts:
- Expressions run in submission order, one at a time, on a worker thread that exists only while there is
  queued work (no thread outlives the program).
- The first failure stops the program: later expressions are skipped and every read raises that error.
- `end()` says nothing more will be queued; `text_iter` readers stop once the queue has drained after it.
- Text events (what `text_iter` follows) are the text as it was appended; `separate_reasoning` later rewrites
  the transcript (`text()`, `messages()`) but not the events already published.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator, Optional

from radixserve.frontend.backends.base import Backend
from radixserve.frontend.choices import score_choices
from radixserve.frontend.ir import (Concat, Gen, Media, Part, RoleBegin, RoleEnd, Select, SeparateReasoning,
                                    SetVariables, VarScopeBegin, VarScopeEnd)
from radixserve.frontend.reasoning import reasoning_variable, split_reasoning
from radixserve.frontend.sampling import SamplingDefaults
from radixserve.frontend.speculative import Speculation
from radixserve.frontend.transcript import Transcript

_LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")

# What text_iter readers see: (variable or None, appended text, meta_info of the generated piece or None).
TextEvent = tuple[Optional[str], str, Optional[dict[str, Any]]]


class ProgramExecutor:
    """The running state of one program (or one fork branch): its transcript, variables, and queue."""

    def __init__(self, backend: Backend, defaults: SamplingDefaults, stream: bool = False,
                 transcript: Optional[Transcript] = None, variables: Optional[dict[str, Any]] = None,
                 scopes: Optional[dict[str, list[int]]] = None, num_api_spec_tokens: Optional[int] = None):
        self.backend = backend
        # API speculative execution (speculative.py); fork branches do without it.
        self.speculation = Speculation(num_api_spec_tokens) if num_api_spec_tokens is not None else None
        self.defaults = defaults
        self.stream = stream
        self.transcript = transcript if transcript is not None else Transcript()
        self.fork_point = len(self.transcript.text)  # where a branch's own text begins
        self.variables: dict[str, Any] = dict(variables or {})
        self.assigned: list[str] = []  # variables this executor set, in order (what a join gathers)
        self.meta_info: dict[str, dict[str, Any]] = {}
        self.scopes: dict[str, list[int]] = {name: list(starts) for name, starts in (scopes or {}).items()}
        self.spans: dict[str, tuple[int, int]] = {}  # where each generated variable's text lies in the transcript
        self.error: Optional[BaseException] = None
        self.children: list[ProgramExecutor] = []
        self._queue: deque[Part] = deque()
        self._working = False  # a worker thread is draining the queue
        self._ended = False
        self._events: list[TextEvent] = []
        self._cond = threading.Condition()

    # ---- queueing --------------------------------------------------------------------------------

    def submit(self, item: Part) -> None:
        with self._cond:
            if self._ended:
                raise RuntimeError("this program has ended; nothing more can be appended to its state")
            self._queue.append(item)
            if not self._working:
                self._working = True
                threading.Thread(target=self._drain, name="radixserve-dsl-program", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._working = False
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
            if self.error is not None:
                continue  # the program already failed: skip the rest
            try:
                self._execute(item)
            except BaseException as error:  # noqa: BLE001 - kept and raised to whoever reads the state
                self.fail(error)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def _idle(self) -> bool:
        return not self._queue and not self._working

    def sync(self) -> None:
        """Wait until everything queued so far has run (successfully or not)."""
        with self._cond:
            self._cond.wait_for(self._idle)

    def end(self) -> None:
        """No more expressions will come (the program function returned); ends the branches too."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
            children = list(self.children)
        for child in children:
            child.end()

    def wait_all(self) -> None:
        """Wait for this executor and every branch forked from it."""
        self.sync()
        for child in list(self.children):
            child.wait_all()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- reading ---------------------------------------------------------------------------------

    def get_variable(self, name: str) -> Any:
        """The value of variable `name`, waiting until it is set. KeyError once the queue has drained
        without setting it; the program's error if it failed first."""
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self.error is not None or self._idle())
            if name in self.variables:
                return self.variables[name]
        self.raise_if_failed()
        raise KeyError(f"the program has no variable {name!r} (set so far: {sorted(self.variables)})")

    def iter_text(self, variable: Optional[str] = None) -> Iterator[str]:
        """Text as it is appended (only variable's, when given), until the program has ended and drained."""
        for text, _ in self.iter_text_with_meta(variable):
            yield text

    def iter_text_with_meta(self, variable: Optional[str] = None) -> Iterator[tuple[str, Optional[dict[str, Any]]]]:
        """(text, meta_info) pieces as in `iter_text`. A generated piece's meta_info is its chunk's, with the
        output logprobs of every token since the previous piece (a chunk without text passes them on); a
        constant text's is None."""
        position = 0
        pending: Optional[dict[str, Any]] = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._events) > position or (self._ended and self._idle())
                                    or self.error is not None)
                events = self._events[position:]
                position = len(self._events)
                done = not events and (self.error is not None or (self._ended and self._idle()))
            for name, text, meta_info in events:
                if variable is not None and name != variable:
                    continue
                if meta_info is not None:
                    pending = meta_info if pending is None else merge_stream_meta(pending, meta_info)
                if text:
                    yield text, pending
                    pending = None
            if done:
                self.raise_if_failed()
                return

    @property
    def ended(self) -> bool:
        """Whether the program function has returned (nothing more will be queued)."""
        with self._cond:
            return self._ended

    def set_after_end(self, name: str, value: Any) -> None:
        """Set a variable of a program that has ended, once everything it queued has run."""
        self.sync()
        self._set(name, value)

    # ---- branches --------------------------------------------------------------------------------

    def fork(self, size: int) -> list["ProgramExecutor"]:
        """`size` branches starting from the text so far. With more than one branch, that text is prefilled
        once first, so every branch's first request finds it in the radix cache."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        self.raise_if_failed()
        if size > 1 and self.transcript.text:
            self.backend.prefill(self.transcript.text)
        children = [ProgramExecutor(self.backend, self.defaults, self.stream, self.transcript.copy(),
                                    self.variables, self.scopes) for _ in range(size)]
        with self._cond:
            self.children.extend(children)
        return children

    # ---- execution (worker thread) ---------------------------------------------------------------

    def _emit(self, text: str, variable: Optional[str] = None, meta_info: Optional[dict[str, Any]] = None) -> None:
        with self._cond:
            self.transcript.append(text)
            self._record(text, variable, meta_info)

    def _record(self, text: str, variable: Optional[str] = None, meta_info: Optional[dict[str, Any]] = None) -> None:
        """Publish appended text to text_iter readers (the caller holds the lock)."""
        if text or meta_info is not None:
            self._events.append((variable, text, meta_info))
            self._cond.notify_all()

    def _set(self, name: str, value: Any, meta_info: Optional[dict[str, Any]] = None) -> None:
        with self._cond:
            self.variables[name] = value
            if name not in self.assigned:
                self.assigned.append(name)
            if meta_info is not None:
                self.meta_info[name] = meta_info
            self._cond.notify_all()

    def _execute(self, item: Part) -> None:
        if self.speculation is not None and not isinstance(item, (str, Concat, Gen, SetVariables, VarScopeBegin,
                                                                  VarScopeEnd)):
            self.speculation.clear()  # a role change, a select, media: the speculated text no longer follows
        if isinstance(item, str):
            if self.speculation is not None:
                self.speculation.follow(item)
            self._emit(item)
        elif isinstance(item, Concat):
            for part in item.parts:
                self._execute(part)
        elif isinstance(item, Gen):
            self._gen(item)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, RoleBegin):
            self._role(item.role, begin=True)
        elif isinstance(item, RoleEnd):
            self._role(item.role, begin=False)
        elif isinstance(item, SetVariables):
            for name, value in item.values:
                self._set(name, value)
        elif isinstance(item, VarScopeBegin):
            self.scopes.setdefault(item.name, []).append(len(self.transcript.text))
        elif isinstance(item, VarScopeEnd):
            self._end_scope(item.name)
        elif isinstance(item, SeparateReasoning):
            self._separate_reasoning(item)
        elif isinstance(item, Media):
            self.backend.check_modality(item.kind)
        else:  # pragma: no cover - ProgramState.__iadd__ checks what it queues
            raise TypeError(f"cannot execute {item!r}")

    def _role(self, role: str, begin: bool) -> None:
        template = self.backend.chat_template
        with self._cond:
            change = self.transcript.begin_role if begin else self.transcript.end_role
            self._record(change(role, template))

    def _end_scope(self, name: str) -> None:
        starts = self.scopes.get(name)
        if not starts:
            raise ValueError(f"var_scope {name!r} ended without being begun")
        self._set(name, self.transcript.text[starts.pop():])

    def _gen(self, gen: Gen) -> None:
        sampling_params, options = self.defaults.resolve(gen.params)
        prompt = self.transcript.text
        spec = self.speculation
        if spec is not None and Speculation.eligible(sampling_params, options, self.stream):
            text = spec.take(sampling_params["stop"])
            if text is None:
                result = self.backend.generate(prompt, spec.request_params(sampling_params), **options)
                spec.fill(result["text"], result["meta_info"])
                text = spec.take(sampling_params["stop"])
            if text is not None:
                self._emit(text, gen.name, spec.meta_info)
                self._finish_gen(gen, prompt, text, spec.meta_info)
                return
        elif spec is not None:
            spec.clear()
        if self.stream:
            text, meta_info = "", {}
            for chunk in self.backend.generate_stream(prompt, sampling_params, **options):
                text += chunk["text"]
                meta_info = merge_stream_meta(meta_info, chunk["meta_info"])
                self._emit(chunk["text"], gen.name, chunk["meta_info"])
        else:
            result = self.backend.generate(prompt, sampling_params, **options)
            text, meta_info = result["text"], result["meta_info"]
            self._emit(text, gen.name, meta_info)
        self._finish_gen(gen, prompt, text, meta_info)

    def _finish_gen(self, gen: Gen, prompt: str, text: str, meta_info: dict[str, Any]) -> None:
        if gen.name is not None:
            self.spans[gen.name] = (len(prompt), len(prompt) + len(text))
            self._set(gen.name, text, meta_info)

    def _select(self, select: Select) -> None:
        prompt = self.transcript.text
        outcome = score_choices(self.backend, prompt, list(select.choices), select.method)
        self._emit(outcome.choice, select.name)
        if select.name is not None:
            self.spans[select.name] = (len(prompt), len(prompt) + len(outcome.choice))
            self._set(select.name, outcome.choice, outcome.meta_info())

    def _separate_reasoning(self, item: SeparateReasoning) -> None:
        """Each variable keeps its answer, `<name>_reasoning_content` gets its reasoning, and the variable's
        text in the transcript becomes the answer (the spans of text after it move with it)."""
        for name in sorted(item.names, key=lambda n: self.spans[n][0], reverse=True):
            start, end = self.spans[name]
            reasoning, answer = split_reasoning(self.variables[name], item.model_type)
            with self._cond:
                self.transcript.replace(start, end, answer)
            shift = len(answer) - (end - start)
            self.spans = {other: (s + shift, e + shift) if s >= end else (s, e)
                          for other, (s, e) in self.spans.items()}
            self.spans[name] = (start, start + len(answer))
            self._set(reasoning_variable(name), reasoning)
            self._set(name, answer)


def merge_stream_meta(so_far: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A stream chunk's meta_info carries the output logprobs of its own tokens only; keep them all."""
    merged = dict(new)
    for key in _LOGPROB_LISTS:
        if key in new or key in so_far:
            merged[key] = list(so_far.get(key, [])) + list(new.get(key, []))
    return merged
