"""Where the processes' sockets live, and how they are made.

Every launch gets a private temporary directory (mode 0700, so no other user can connect) holding three
`ipc://` endpoints, one per hop of the pipeline:

    TokenizerManager --tokenizer_to_scheduler--> Scheduler --scheduler_to_detokenizer--> DetokenizerManager
    DetokenizerManager --detokenizer_to_tokenizer--> TokenizerManager

Receivers BIND their PULL socket and senders CONNECT their PUSH socket, so each endpoint has exactly one
owner (the receiver) and any number of senders. Sockets carry `radixserve.runtime.wire.messages.encode` bytes.
This module is light (no torch) so the children can import it first thing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq


@dataclass
class IpcPaths:
    tokenizer_to_scheduler: str
    scheduler_to_detokenizer: str
    detokenizer_to_tokenizer: str
    tmp_dir: str

    @classmethod
    def create(cls) -> "IpcPaths":
        """Make a fresh 0700 directory and the three endpoint URLs inside it."""
        tmp_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")  # mkdtemp creates it with mode 0700
        os.chmod(tmp_dir, 0o700)
        return cls(
            tokenizer_to_scheduler=f"ipc://{tmp_dir}/tokenizer_to_scheduler",
            scheduler_to_detokenizer=f"ipc://{tmp_dir}/scheduler_to_detokenizer",
            detokenizer_to_tokenizer=f"ipc://{tmp_dir}/detokenizer_to_tokenizer",
            tmp_dir=tmp_dir,
        )

    # With --dp-size N the data-parallel controller binds `tokenizer_to_scheduler` and hands each request to
    # replica i's own endpoint; the replicas report their load back on one endpoint of the controller's.
    def replica_input(self, dp_rank: int) -> str:
        return f"ipc://{self.tmp_dir}/controller_to_scheduler_{dp_rank}"

    @property
    def replica_reports(self) -> str:
        return f"ipc://{self.tmp_dir}/scheduler_to_controller"

    def remove(self) -> None:
        """Delete the directory and its socket files (idempotent)."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


# A sender keeps unsent messages this long after close/exit: a child that reports ProcessFailed and exits
# must not lose the report while its receiver is still starting up; bounded so nobody hangs on a dead peer.
PUSH_LINGER_MS = 10_000


def _configure(socket: zmq.Socket, linger_ms: int) -> None:
    # No high-water mark: a burst of outputs must queue rather than block a process's loop or be dropped.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)


def make_pull(ctx: zmq.Context, url: str, bind: bool = True) -> zmq.Socket:
    """A PULL socket on `url`; receivers bind (the default)."""
    socket = ctx.socket(zmq.PULL)
    _configure(socket, linger_ms=0)
    socket.bind(url) if bind else socket.connect(url)
    return socket


def make_push(ctx: zmq.Context, url: str, bind: bool = False) -> zmq.Socket:
    """A PUSH socket on `url`; senders connect (the default).

    Messages sent before the peer binds are queued, and kept up to PUSH_LINGER_MS after close; call
    `socket.close(linger=0)` where dropping them is wanted (a parent shutting down).
    """
    socket = ctx.socket(zmq.PUSH)
    _configure(socket, linger_ms=PUSH_LINGER_MS)
    socket.bind(url) if bind else socket.connect(url)
    return socket
