"""The scheduler's watchdog (`--watchdog-timeout`, SGLang's flag): a step that makes no progress for that many
seconds ends the scheduler process.

The process loop wraps each round of work (handling the messages received, one `Scheduler.step()`, sending
the outputs) in `StepWatchdog.busy()`. A daemon thread looks a few times per timeout at the round in
progress; if the same round is still running `timeout` seconds after it began, the model or a kernel is
stuck (a hung device, a collective that never returns): the thread logs what the scheduler was doing and the
stack of every thread, and exits the process with status 1. The parent then sees a dead child instead of
requests that never finish; what it does about that is the parent's business. Waiting for messages while
idle is not a round of work, so an idle scheduler never trips the watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

EXIT_CODE = 1
MAX_LISTED_RIDS = 16


class StepWatchdog:
    def __init__(self, timeout: float, describe: Callable[[], str], exit: Callable[[int], None] = os._exit) -> None:
        """`describe()` returns the state to log when the watchdog fires; `exit` ends the process."""
        self.timeout = timeout
        self._describe = describe
        self._exit = exit
        self._rounds = 0  # rounds of work finished
        # (round number, monotonic start) of the round in progress, None between rounds. One attribute, so the
        # watching thread always reads a consistent pair.
        self._current: Optional[tuple[int, float]] = None

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._current = (self._rounds, time.monotonic())
        try:
            yield
        finally:
            self._current = None
            self._rounds += 1

    def start(self) -> None:
        threading.Thread(target=self._watch, name="radixserve-watchdog", daemon=True).start()

    def _watch(self) -> None:
        period = min(max(self.timeout / 4, 0.01), 5.0)
        while True:
            time.sleep(period)
            current = self._current
            if current is not None and time.monotonic() - current[1] > self.timeout:
                self._fire(*current)
                return

    def _fire(self, round_number: int, started: float) -> None:
        try:
            state = self._describe()
        except Exception as error:  # the state is read while the loop may be changing it
            state = f"(state unavailable: {error!r})"
        logger.error(
            "watchdog: scheduler round %d has made no progress for %.1f s (--watchdog-timeout %.1f s); "
            "exiting.\nstate: %s\n%s", round_number, time.monotonic() - started, self.timeout, state, _all_stacks())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self._exit(EXIT_CODE)


def describe_scheduler(scheduler: "Scheduler") -> str:
    """A one-line summary of what the scheduler holds, for the watchdog's report."""
    running = [req.rid for req in list(scheduler.running)]
    waiting = [req.rid for req in list(scheduler.waiting)]
    chunked = scheduler.chunked_req.rid if scheduler.chunked_req is not None else None
    batches = [launched.batch.mode.name for launched in list(scheduler.inflight)]
    return (f"{len(running)} running {running[:MAX_LISTED_RIDS]}, {len(waiting)} waiting {waiting[:MAX_LISTED_RIDS]}, "
            f"chunked prefill: {chunked}, batches in flight: {batches}")


def _all_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)
