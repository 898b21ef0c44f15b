"""An authenticated way into a tensor-parallel group's rendezvous (torch's TCPStore) across hosts.

torch.distributed's store authenticates nobody: whoever reaches its port can read and write the keys the ranks meet
by, and so break or hijack the group. With a shared secret (runtime/wire/dist_secret.py) the store listens on node
0's loopback only, and two forwarders carry the ranks' connections to it:

    TCPStore client -> AuthTunnel (127.0.0.1, in the rank's process)
        == handshake, then the store's bytes ==> AuthGate (--dist-init-addr, node 0) -> TCPStore (127.0.0.1)

torch's store client and server are unchanged; a connection reaches the store only after it passed the handshake.

The handshake is a mutual HMAC-SHA256 challenge-response over fresh nonces (K: the group's secret):

    gate   -> tunnel:  MAGIC || Ng                                   (Ng, Nt: 32 random bytes each)
    tunnel -> gate:    Nt || HMAC(K, "tunnel" || MAGIC || Ng || Nt)
    gate   -> tunnel:  HMAC(K, "gate" || MAGIC || Ng || Nt)

Each side compares the other's tag in constant time (`hmac.compare_digest`) and hangs up on a mismatch. Both nonces
are fresh, so a recorded exchange cannot be replayed to either side, and the labels keep one side's tag from ever
being the other's. The gate reads exactly the 64 bytes the protocol expects, within HANDSHAKE_TIMEOUT_S for the
whole exchange, and lets at most MAX_PENDING_HANDSHAKES connections wait at once: a client that sends garbage, too
much, too little or too slowly is refused at once or at the deadline. Each refusal logs one line with the peer's
address.

Not given here: confidentiality. After the handshake the store's bytes travel in the clear, as the collectives' do
(docs/security.md says what crosses the network and who must protect it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

MAGIC = b"radixserve-rendezvous-auth/1\n"
NONCE_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64
_CHUNK_BYTES = 64 * 1024
_RETRY_S = (0.05, 1.0)  # the tunnel's first and longest wait between attempts to reach a gate that is not up yet


class HandshakeError(ConnectionError):
    """The peer did not prove that it holds the group's secret, or broke off the handshake."""


def _tag(secret: bytes, label: bytes, gate_nonce: bytes, tunnel_nonce: bytes) -> bytes:
    return hmac.new(secret, label + MAGIC + gate_nonce + tunnel_nonce, hashlib.sha256).digest()


def _remaining(deadline: float, done: int, size: int) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise HandshakeError(f"no complete handshake within the deadline ({done} of {size} bytes)")
    return remaining


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    received = bytearray()
    while len(received) < size:
        sock.settimeout(_remaining(deadline, len(received), size))
        try:
            chunk = sock.recv(size - len(received))
        except TimeoutError:
            continue  # the deadline check above ends it
        if not chunk:
            raise HandshakeError(f"the peer hung up after {len(received)} of {size} handshake bytes")
        received += chunk
    return bytes(received)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline, 0, len(data)))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise HandshakeError("the peer does not read the handshake") from None


def gate_handshake(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The gate's side. Returns once the peer has proved it holds `secret` and has been sent the gate's own proof;
    HandshakeError otherwise. Reads exactly NONCE_BYTES + TAG_BYTES from the peer."""
    deadline = time.monotonic() + timeout_s
    gate_nonce = os.urandom(NONCE_BYTES)
    _send(sock, MAGIC + gate_nonce, deadline)
    reply = _recv_exact(sock, NONCE_BYTES + TAG_BYTES, deadline)
    tunnel_nonce, tag = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, b"tunnel", gate_nonce, tunnel_nonce)):
        raise HandshakeError("wrong secret (the peer's proof does not match)")
    _send(sock, _tag(secret, b"gate", gate_nonce, tunnel_nonce), deadline)
    sock.settimeout(None)


def tunnel_handshake(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The connecting side. Returns once the gate has proved it holds `secret`; HandshakeError otherwise."""
    deadline = time.monotonic() + timeout_s
    hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not hmac.compare_digest(hello[:len(MAGIC)], MAGIC):
        raise HandshakeError("the peer is not a radixserve rendezvous (unexpected greeting)")
    gate_nonce, tunnel_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    _send(sock, tunnel_nonce + _tag(secret, b"tunnel", gate_nonce, tunnel_nonce), deadline)
    try:
        tag = _recv_exact(sock, TAG_BYTES, deadline)
    except HandshakeError as error:
        raise HandshakeError(f"the rendezvous refused this node's proof; do the nodes hold the same secret? "
                             f"({error})") from None
    if not hmac.compare_digest(tag, _tag(secret, b"gate", gate_nonce, tunnel_nonce)):
        raise HandshakeError("wrong secret (the rendezvous' proof does not match)")
    sock.settimeout(None)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to `host` (a name or an address; never widened to every interface) and
    `port` (0: one the kernel picks)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def _splice(first: socket.socket, second: socket.socket) -> None:
    """Copy bytes both ways between two connected sockets until either side ends; then close both."""

    def copy(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(_CHUNK_BYTES):
                sink.sendall(chunk)
        except OSError:
            pass
        for end in (source, sink):  # wakes the other direction's recv
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    backward = threading.Thread(target=copy, args=(second, first), name="radixserve-rendezvous-copy", daemon=True)
    backward.start()
    copy(first, second)
    backward.join()
    first.close()
    second.close()


class _Forwarder:
    """A listener whose accept loop hands each connection to `_forward` on a thread of its own."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self._listener = listener
        self._name = name
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self):
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting (connections already forwarded run on until their ends close them)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            self._accepted(conn, peer)

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        threading.Thread(target=self._forward, args=(conn, peer), name=f"{self._name}-conn", daemon=True).start()

    def _forward(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError


class AuthGate(_Forwarder):
    """Node 0's door to the store: every connection to `listener` must pass `gate_handshake` before it is joined to
    a new connection to `target` (the store on loopback). `admitted` and `refused` count connections."""

    def __init__(self, listener: socket.socket, target: tuple[str, int], secret: bytes,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        super().__init__(listener, "radixserve-rendezvous-gate")
        self._target = target
        self._secret = secret
        self._timeout_s = handshake_timeout_s
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._count_lock = threading.Lock()
        self.admitted = 0
        self.refused = 0

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        if not self._pending.acquire(blocking=False):
            self._refuse(conn, peer, f"{MAX_PENDING_HANDSHAKES} handshakes are pending already")
            return
        super()._accepted(conn, peer)

    def _refuse(self, conn: socket.socket, peer: tuple, reason: str) -> None:
        with self._count_lock:
            self.refused += 1
        logger.warning("refused a rendezvous connection from %s port %s: %s", peer[0], peer[1], reason)
        conn.close()

    def _forward(self, conn: socket.socket, peer: tuple) -> None:
        try:
            gate_handshake(conn, self._secret, self._timeout_s)
        except OSError as error:  # HandshakeError, or the peer reset the connection
            self._refuse(conn, peer, str(error) or type(error).__name__)
            return
        finally:
            self._pending.release()
        try:
            store = socket.create_connection(self._target, timeout=self._timeout_s)
        except OSError as error:
            logger.error("the rendezvous store at %s port %s cannot be reached: %s", *self._target, error)
            conn.close()
            return
        store.settimeout(None)
        with self._count_lock:
            self.admitted += 1
        _splice(conn, store)


class AuthTunnel(_Forwarder):
    """A rank's way to the gate: listens on loopback (a port the kernel picks) and carries each local connection to
    the gate at `remote` once `tunnel_handshake` passed. A gate that is not up yet is retried until
    `connect_timeout_s` (the group's start-up deadline); a failed handshake is not retried."""

    def __init__(self, remote: tuple[str, int], secret: bytes, connect_timeout_s: float,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        super().__init__(listen("127.0.0.1", 0), "radixserve-rendezvous-tunnel")
        self._remote = remote
        self._secret = secret
        self._connect_timeout_s = connect_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self.refusal: Optional[HandshakeError] = None  # the first failed handshake (torch's client would retry)

    def _forward(self, conn: socket.socket, peer: tuple) -> None:
        gate = self._connect()
        if gate is None:
            conn.close()
            return
        try:
            tunnel_handshake(gate, self._secret, self._handshake_timeout_s)
        except OSError as error:
            logger.error("the rendezvous at %s port %s: %s", *self._remote, error)
            if isinstance(error, HandshakeError) and self.refusal is None:
                self.refusal = HandshakeError(f"the rendezvous at {self._remote[0]} port {self._remote[1]}: {error}")
            gate.close()
            conn.close()
            return
        _splice(conn, gate)

    def _connect(self) -> Optional[socket.socket]:
        deadline = time.monotonic() + self._connect_timeout_s
        wait_s = _RETRY_S[0]
        while True:
            try:
                return socket.create_connection(self._remote, timeout=min(self._connect_timeout_s, 30.0))
            except OSError as error:
                if time.monotonic() + wait_s > deadline:
                    logger.error("the rendezvous at %s port %s cannot be reached: %s", *self._remote, error)
                    return None
            time.sleep(wait_s)
            wait_s = min(wait_s * 2, _RETRY_S[1])
