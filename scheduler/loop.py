"""The scheduler process's loop, one for every rank: wait for the next round's messages, then do the round's work
under the step watchdog.

    wait for messages (block only when idle) -> [watched] handle them -> step -> send outputs

Where a round's messages come from is its `InputSource`: the PULL socket of a scheduler on its own
(`SocketInput`), or, for each rank of a tensor-parallel group, rank 0's socket relayed to every rank
(`scheduler/tp.py::TPInput`). Waiting for messages is not work, so an idle scheduler never trips the watchdog.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import zmq

from radixserve.runtime.wire.messages import decode, encode
from radixserve.scheduler.watchdog import StepWatchdog

IDLE_POLL_MS = 1000  # an idle scheduler wakes up this often even without messages
BUSY_POLL_MS = 1  # a scheduler with nothing runnable (e.g. waiting for memory) naps this long


class InputSource(Protocol):
    """The messages of each round of a scheduler's loop."""

    def receive(self, timeout_ms: int, idle: bool, watchdog: StepWatchdog) -> list[bytes]:
        """The encoded messages of the next round, in order (possibly none); waits up to `timeout_ms` for the
        first. `idle`: whether the scheduler was idle before the wait. Waiting is not work; anything the source
        does that must finish promptly runs under `watchdog.busy()`."""

    def start_round(self, scheduler: Any) -> None:
        """Work of the round before its messages are handled (watched)."""

    def before_step(self, scheduler: Any) -> None:
        """Work of the round after its messages are handled, before the step (watched)."""


class SocketInput:
    """The messages that arrived on a PULL socket."""

    def __init__(self, receiver: zmq.Socket) -> None:
        self.receiver = receiver
        self.poller = zmq.Poller()
        self.poller.register(receiver, zmq.POLLIN)

    def receive(self, timeout_ms: int, idle: bool, watchdog: StepWatchdog) -> list[bytes]:
        messages: list[bytes] = []
        if self.poller.poll(timeout_ms):
            while True:
                try:
                    messages.append(self.receiver.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return messages

    def start_round(self, scheduler: Any) -> None:
        pass

    def before_step(self, scheduler: Any) -> None:
        pass


def serve(scheduler: Any, source: InputSource, sender: Optional[zmq.Socket], watchdog: StepWatchdog,
          reporter: Any = None) -> None:
    """The loop: never spins when idle (blocks on the input), never blocks while there is work; never returns.
    `sender`: where outputs go (None: dropped, on the ranks of a tensor-parallel group after the first); a
    data-parallel replica's `reporter` hears of each request and reports after each round."""
    worked = True
    while True:
        idle = scheduler.is_idle()
        messages = source.receive(IDLE_POLL_MS if idle else (0 if worked else BUSY_POLL_MS), idle, watchdog)
        with watchdog.busy():
            source.start_round(scheduler)
            for data in messages:
                message = decode(data)
                if reporter is not None:
                    reporter.received_request(message)
                scheduler.handle_message(message)
            source.before_step(scheduler)
            worked = scheduler.step()
            outputs = scheduler.take_outputs()
            if sender is not None:
                for message in outputs:
                    sender.send(encode(message))
            if reporter is not None:
                reporter.after_round()
