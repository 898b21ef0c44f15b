"""The scheduler loop of a tensor-parallel group: rank 0 relays its messages, every rank steps in lockstep.

Every rank runs its own Scheduler over its own shard of the model. They stay identical because they see the
same inputs in the same order: once per loop iteration, rank 0 broadcasts the raw bytes of the messages it
received from the TokenizerManager (possibly none) over the gloo CPU group, then every rank handles them and
runs one `step()`. Scheduling is deterministic given those inputs (sampled ids are broadcast from rank 0 by the
ModelRunner), so every rank builds the same batches, and the forward pass's collectives always pair up. Only
rank 0 sends outputs; the others drop theirs.

A desync would otherwise be silent (or a hang), so it is checked: when rank 0 goes idle after work, it asks
every rank for a digest of its scheduler state (free and evictable KV slots, tree size, request rows); a
mismatch raises `TPDesyncError` on every rank, and the process dies, which ends the group.

Grammar compilation, the one input that arrives on a timer of its own (a worker thread), is waited for before
the step under TP, so every rank admits a structured-output request at the same step.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
import zmq

from radixserve.runtime.wire.messages import decode, encode
from radixserve.scheduler.watchdog import StepWatchdog

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
BUSY_POLL_MS = 1


class TPDesyncError(RuntimeError):
    """The ranks of a tensor-parallel group no longer hold the same scheduler state."""


@dataclass
class TPStepInput:
    """What rank 0 sends every rank before each step: the encoded messages it received, in order, and
    whether to compare state digests before handling them (the scheduler is idle then, on every rank)."""

    messages: list[bytes] = field(default_factory=list)
    check_digest: bool = False


def state_digest(scheduler: Any) -> str:
    """A digest of the state that identical scheduling must keep identical across ranks."""
    cache = scheduler.cache
    parts = (
        scheduler.allocator.available_size(),
        cache.evictable_size(),
        cache.protected_size(),
        scheduler.req_to_token_pool.available_size(),
        len(scheduler.reqs),
        len(scheduler.waiting),
        len(scheduler.running),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class TPRelay:
    """One rank's end of the per-step broadcast over the CPU group."""

    def __init__(self, rank: int, cpu_group: Any) -> None:
        self.rank = rank
        self.cpu_group = cpu_group

    def exchange(self, step_input: Optional[TPStepInput]) -> TPStepInput:
        """Rank 0 passes its input and gets it back; other ranks pass None and get rank 0's."""
        box = [step_input]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def check_digests(self, scheduler: Any) -> None:
        """Raise TPDesyncError (on every rank) unless every rank's state digest is the same."""
        digests: list[Optional[str]] = [None] * dist.get_world_size(self.cpu_group)
        dist.all_gather_object(digests, state_digest(scheduler), group=self.cpu_group)
        if len(set(digests)) != 1:
            raise TPDesyncError(f"tensor-parallel ranks diverged: state digests by rank {digests}")


def serve_tp(scheduler: Any, relay: TPRelay, receiver: Optional[zmq.Socket], sender: Optional[zmq.Socket],
             watchdog: StepWatchdog, reporter: Any = None) -> None:
    """The loop of every rank (rank 0 with its sockets and, in a data-parallel replica, its reporter; the
    others with None): never returns. `watchdog` watches each rank's round of work after the exchange; waiting
    in the exchange for rank 0 is not work, so an idle group never trips it, and a rank stuck in a step (or in
    a collective whose peer is stuck) ends its process, which takes the group down."""
    poller = zmq.Poller()
    if receiver is not None:
        poller.register(receiver, zmq.POLLIN)
    worked = True
    checked = True
    while True:
        step_input = None
        if relay.rank == 0:
            idle = scheduler.is_idle()
            timeout = IDLE_POLL_MS if idle else (0 if worked else BUSY_POLL_MS)
            step_input = TPStepInput(_drain(receiver, poller, timeout), check_digest=idle and not checked)
            checked = idle
        step_input = relay.exchange(step_input)
        with watchdog.busy():
            worked = _round(scheduler, relay, step_input, sender, reporter)


def _round(scheduler: Any, relay: TPRelay, step_input: TPStepInput, sender: Optional[zmq.Socket],
           reporter: Any) -> bool:
    """One round of work on every rank: the messages of this round, one step, the outputs (rank 0 sends)."""
    if step_input.check_digest:
        relay.check_digests(scheduler)
    for data in step_input.messages:
        message = decode(data)
        if reporter is not None:
            reporter.received_request(message)
        scheduler.handle_message(message)
    if scheduler.grammars.num_queued:
        # Grammars compile on a thread whose finishing time differs by rank: wait, so that every rank
        # admits a grammar request at the same step.
        scheduler.grammars.wait_for_queue()
    worked = scheduler.step()
    outputs = scheduler.take_outputs()
    if sender is not None:
        for message in outputs:
            sender.send(encode(message))
    if reporter is not None:
        reporter.after_round()
    return worked


def _drain(receiver: zmq.Socket, poller: zmq.Poller, timeout_ms: int) -> list[bytes]:
    messages: list[bytes] = []
    if poller.poll(timeout_ms):
        while True:
            try:
                messages.append(receiver.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
    return messages
