"""The input of a tensor-parallel group's scheduler loop (scheduler/loop.py): rank 0 relays its messages, every
rank steps in lockstep.

Every rank runs its own Scheduler over its own shard of the model. They stay identical because they see the
same inputs in the same order: once per loop iteration, rank 0 broadcasts the raw bytes of the messages it
received from the TokenizerManager (possibly none) over the gloo CPU group, then every rank handles them and
runs one `step()` (`TPInput` is each rank's input source). Scheduling is deterministic given those inputs
(sampled ids are broadcast from rank 0 by the ModelRunner), so every rank builds the same batches, and the
forward pass's collectives always pair up. Only rank 0 sends outputs; the others drop theirs.

A desync would otherwise be silent (or a hang), so it is checked: when rank 0 goes idle after work, it asks
every rank for a digest of its scheduler state (free and evictable KV slots, tree size, request rows); a
mismatch raises `TPDesyncError` on every rank, and the process dies, which ends the group.

Grammar compilation, the one input that arrives on a timer of its own (a worker thread), is waited for before
the step under TP, so every rank admits a structured-output request at the same step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from radixserve.scheduler.loop import InputSource


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


class TPInput:
    """The input of every rank of a tensor-parallel group (scheduler/loop.py): rank 0 receives from its socket
    and broadcasts the round's messages; the others take them from the broadcast. Waiting in the exchange for rank
    0 is not work, so an idle group never trips the watchdog; a rank stuck in a step (or in a collective whose
    peer is stuck) ends its process, which takes the group down."""

    def __init__(self, relay: TPRelay, socket: Optional[InputSource]) -> None:
        """`socket`: rank 0's input (None on the other ranks)."""
        self.relay = relay
        self.socket = socket
        self._checked = True  # rank 0: the digests were compared since the group last worked
        self._check_digest = False  # this round compares them

    def receive(self, timeout_ms: int, idle: bool) -> list[bytes]:
        step_input = None
        if self.relay.rank == 0:
            assert self.socket is not None, "rank 0 of a tensor-parallel group receives the messages"
            step_input = TPStepInput(self.socket.receive(timeout_ms, idle), check_digest=idle and not self._checked)
            self._checked = idle
        step_input = self.relay.exchange(step_input)
        self._check_digest = step_input.check_digest
        return step_input.messages

    def start_round(self, scheduler: Any) -> None:
        if self._check_digest:
            self.relay.check_digests(scheduler)

    def before_step(self, scheduler: Any) -> None:
        if scheduler.grammars.num_queued:
            # Grammars compile on a thread whose finishing time differs by rank: wait, so that every rank
            # admits a grammar request at the same step.
            scheduler.grammars.wait_for_queue()
