"""The input of a tensor-parallel group's scheduler loop (scheduler/loop.py): rank 0 relays its messages, every
rank steps in lockstep.

Every rank runs its own Scheduler over its own shard of the model. They stay identical because they see the
same inputs in the same order: once per loop iteration, rank 0 broadcasts the raw bytes of the messages it
received from the TokenizerManager (possibly none) over the gloo CPU group, then every rank handles them and
runs one `step()` (`TPInput` is each rank's input source). Scheduling is deterministic given those inputs
(sampled ids are broadcast from rank 0 by the ModelRunner), so every rank builds the same batches, and the
forward pass's collectives always pair up. Only rank 0 sends outputs; the others drop theirs.

The relay carries bytes only: rank 0 encodes the round as a msgspec struct and broadcasts it as a uint8 tensor (its
length first); no rank unpickles anything a peer sent, so a stray client on a group port cannot run code here.

A desync would otherwise be silent (or a hang), so it is checked: when rank 0 goes idle after work, it asks
every rank for a digest of its scheduler state (free and evictable KV slots, tree size, request rows); a
mismatch raises `TPDesyncError` on every rank, and the process dies, which ends the group.

Grammar compilation, the one input that arrives on a timer of its own (a worker thread), is waited for before
the step under TP, so every rank admits a structured-output request at the same step.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import msgspec
import torch
import torch.distributed as dist

from radixserve.scheduler.loop import InputSource
from radixserve.scheduler.watchdog import StepWatchdog


class TPDesyncError(RuntimeError):
    """The ranks of a tensor-parallel group no longer hold the same scheduler state."""


class TPStepInput(msgspec.Struct, frozen=True):
    """What rank 0 sends every rank before each step: the encoded messages it received, in order, and
    whether to compare state digests before handling them (the scheduler is idle then, on every rank)."""

    messages: list[bytes] = []
    check_digest: bool = False


_STEP_INPUT_DECODER = msgspec.msgpack.Decoder(TPStepInput)
DIGEST_CHARS = 16


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
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:DIGEST_CHARS]


class TPRelay:
    """One rank's end of the per-step broadcast over the CPU group."""

    def __init__(self, rank: int, cpu_group: Any) -> None:
        self.rank = rank
        self.cpu_group = cpu_group

    def exchange(self, step_input: Optional[TPStepInput]) -> TPStepInput:
        """Rank 0 passes its input and gets it back; other ranks pass None and get rank 0's."""
        if self.rank == 0:
            assert step_input is not None
            payload = msgspec.msgpack.encode(step_input)
            size = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.cpu_group)
        return step_input if self.rank == 0 else _STEP_INPUT_DECODER.decode(data.numpy().tobytes())

    def check_digests(self, scheduler: Any) -> None:
        """Raise TPDesyncError (on every rank) unless every rank's state digest is the same."""
        mine = torch.tensor(list(state_digest(scheduler).encode("ascii")), dtype=torch.uint8)
        gathered = [torch.empty(DIGEST_CHARS, dtype=torch.uint8) for _ in range(dist.get_world_size(self.cpu_group))]
        dist.all_gather(gathered, mine, group=self.cpu_group)
        digests = [bytes(tensor.tolist()).decode("ascii") for tensor in gathered]
        if len(set(digests)) != 1:
            raise TPDesyncError(f"tensor-parallel ranks diverged: state digests by rank {digests}")


class TPInput:
    """The input of every rank of a tensor-parallel group (scheduler/loop.py): rank 0 receives from its socket
    and broadcasts the round's messages; the others take them from the broadcast. Waiting in the exchange for rank
    0 is not work, so an idle group never trips the watchdog; rank 0's own end of the exchange is work, since the
    others are waiting for it. A rank stuck in a step (or in a collective whose peer is stuck) ends its process,
    which takes the group down."""

    def __init__(self, relay: TPRelay, socket: Optional[InputSource]) -> None:
        """`socket`: rank 0's input (None on the other ranks)."""
        self.relay = relay
        self.socket = socket
        self._checked = True  # rank 0: the digests were compared since the group last worked
        self._check_digest = False  # this round compares them

    def receive(self, timeout_ms: int, idle: bool, watchdog: StepWatchdog) -> list[bytes]:
        if self.relay.rank == 0:
            assert self.socket is not None, "rank 0 of a tensor-parallel group receives the messages"
            step_input = TPStepInput(self.socket.receive(timeout_ms, idle, watchdog),
                                     check_digest=idle and not self._checked)
            self._checked = idle
            # Every other rank already waits in the exchange, so rank 0's end of it is work: a broadcast that
            # blocks here has a stuck peer (gloo's root waits for each receiver to take its message).
            with watchdog.busy():
                step_input = self.relay.exchange(step_input)
        else:
            step_input = self.relay.exchange(None)
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
