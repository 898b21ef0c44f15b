"""The tensor-parallel group's TCP ports (docs/security.md, "Listening sockets" and "Across hosts").

- The handshake of the authenticated rendezvous (model_runner/dist_auth.py) on real socket pairs: the right secret
  passes both ways; a wrong secret, a truncated or replayed handshake, a client past the deadline and a flood of
  bytes are refused.
- The gate and a tunnel in front of a real torch TCPStore: a rank's store client works through them; a raw socket,
  torch's own store client and a wrong secret at the gate are refused and the store's keys are untouched.
- The secret's checks at start (ServerArgs): `--nnodes > 1` without one is refused naming the flag; a file others
  may read, a short secret, a symbolic link are refused.
- Real servers (slow): a TP=2 group on one host listens on loopback only, and garbage sent to each of its ports
  (the store's and gloo's) leaves it serving the same greedy ids; clients without the secret at a two-"node"
  group's rendezvous port are refused while it keeps serving the same ids.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from radixserve.model_runner.dist_auth import (MAGIC, NONCE_BYTES, TAG_BYTES, AuthGate, AuthTunnel, HandshakeError,
                                               gate_handshake, listen, tunnel_handshake)
from radixserve.runtime.wire.dist_secret import MIN_SECRET_BYTES, SECRET_ENV, load_dist_secret

pytestmark = pytest.mark.timeout(300)
SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Side(threading.Thread):
    """Runs one side of a handshake; `error` is what it raised (None: it passed)."""

    def __init__(self, handshake, sock: socket.socket, secret: bytes, **kwargs) -> None:
        super().__init__(daemon=True)
        self.handshake, self.sock, self.secret, self.kwargs = handshake, sock, secret, kwargs
        self.error = None
        self.seconds = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.handshake(self.sock, self.secret, **self.kwargs)
        except Exception as error:  # recorded for the test to assert on
            self.error = error
        self.seconds = time.monotonic() - started

    def result(self):
        self.join(timeout=30)
        assert not self.is_alive()
        return self.error


# ---- the handshake ------------------------------------------------------------------------------------------------

def test_the_same_secret_passes_both_ways():
    gate_end, tunnel_end = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET)
    gate.start()
    tunnel_handshake(tunnel_end, SECRET)
    assert gate.result() is None
    # Afterwards the connection carries the caller's bytes unchanged.
    tunnel_end.sendall(b"payload")
    assert gate_end.recv(16) == b"payload"


def test_a_wrong_secret_is_refused_by_both_sides():
    gate_end, tunnel_end = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET)
    gate.start()
    tunnel = _Side(tunnel_handshake, tunnel_end, OTHER_SECRET)
    tunnel.start()
    assert isinstance(gate.result(), HandshakeError) and "wrong secret" in str(gate.error)
    gate_end.close()  # the gate hangs up on a refusal
    assert isinstance(tunnel.result(), HandshakeError) and "same secret" in str(tunnel.error)


def test_a_gate_that_does_not_know_the_secret_is_refused_by_the_tunnel():
    """Mutual: a listener that merely speaks the protocol (a stray server at the rendezvous address) cannot pass
    itself off as the gate."""
    gate_end, tunnel_end = socket.socketpair()
    tunnel = _Side(tunnel_handshake, tunnel_end, SECRET)
    tunnel.start()
    gate_nonce = os.urandom(NONCE_BYTES)
    gate_end.sendall(MAGIC + gate_nonce)
    assert len(gate_end.recv(NONCE_BYTES + TAG_BYTES, socket.MSG_WAITALL)) == NONCE_BYTES + TAG_BYTES
    gate_end.sendall(os.urandom(TAG_BYTES))
    assert isinstance(tunnel.result(), HandshakeError) and "rendezvous' proof" in str(tunnel.error)


def test_a_tunnel_refuses_a_peer_that_is_no_rendezvous():
    gate_end, tunnel_end = socket.socketpair()
    tunnel = _Side(tunnel_handshake, tunnel_end, SECRET)
    tunnel.start()
    gate_end.sendall(b"HTTP/1.1 400 Bad Request\r\n" + b"x" * 64)
    assert isinstance(tunnel.result(), HandshakeError) and "not a radixserve rendezvous" in str(tunnel.error)


def test_a_truncated_handshake_is_refused_at_once():
    gate_end, client = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET)
    gate.start()
    client.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
    client.sendall(os.urandom(10))
    client.close()
    assert isinstance(gate.result(), HandshakeError) and "after 10 of 64" in str(gate.error)
    assert gate.seconds < 2.0


def test_a_slow_client_is_refused_at_the_deadline():
    """One byte every 0.1 s would finish after 6.4 s; the whole handshake has 0.5 s."""
    gate_end, client = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET, timeout_s=0.5)
    gate.start()
    for _ in range(20):
        if not gate.is_alive():
            break
        try:
            client.sendall(b"x")
        except OSError:
            break
        time.sleep(0.1)
    assert isinstance(gate.result(), HandshakeError) and "deadline" in str(gate.error)
    assert 0.5 <= gate.seconds < 1.5


def test_a_flood_of_bytes_is_read_only_as_far_as_the_handshake_and_refused():
    gate_end, client = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET)
    gate.start()
    client.settimeout(5.0)
    flood = threading.Thread(target=lambda: _send_quietly(client, os.urandom(1 << 20)), daemon=True)
    flood.start()
    assert isinstance(gate.result(), HandshakeError) and "wrong secret" in str(gate.error)
    assert gate.seconds < 2.0


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def test_a_recorded_handshake_cannot_be_replayed():
    """A valid proof seen on the wire answers only that gate nonce: sent to a fresh handshake it is refused."""
    gate_end, tunnel_end = socket.socketpair()
    gate = _Side(gate_handshake, gate_end, SECRET)
    gate.start()
    tunnel_end.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
    # What a genuine tunnel sent to another gate (whose nonce differed).
    other_gate, other_tunnel = socket.socketpair()
    recorder = _Side(gate_handshake, other_gate, SECRET)
    recorder.start()
    recorded = []
    real = threading.Thread(target=lambda: recorded.append(_tunnel_reply(other_tunnel)), daemon=True)
    real.start()
    real.join(timeout=10)
    assert recorder.result() is None
    tunnel_end.sendall(recorded[0])
    assert isinstance(gate.result(), HandshakeError) and "wrong secret" in str(gate.error)


def _tunnel_reply(sock: socket.socket) -> bytes:
    """Run a genuine tunnel handshake over `sock` and return the bytes it sent (read back through a socket pair
    spliced in between)."""
    middle_gate, middle_tunnel = socket.socketpair()
    sent = bytearray()

    def relay_to_tunnel() -> None:
        middle_gate.sendall(sock.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL))
        reply = middle_gate.recv(NONCE_BYTES + TAG_BYTES, socket.MSG_WAITALL)
        sent.extend(reply)
        sock.sendall(reply)
        middle_gate.sendall(sock.recv(TAG_BYTES, socket.MSG_WAITALL))

    relay = threading.Thread(target=relay_to_tunnel, daemon=True)
    relay.start()
    tunnel_handshake(middle_tunnel, SECRET)
    relay.join(timeout=10)
    return bytes(sent)


# ---- the gate and a tunnel in front of a real store ---------------------------------------------------------------

@pytest.fixture
def gated_store():
    """A TCPStore on loopback behind a gate on another loopback port: (store as its host sees it, gate)."""
    import torch.distributed as dist

    store_listener = listen("127.0.0.1", 0)
    host, port = store_listener.getsockname()[:2]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30), master_listen_fd=store_listener.detach())
    gate = AuthGate(listen("127.0.0.1", 0), (host, port), SECRET, handshake_timeout_s=2.0).start()
    try:
        yield store, gate
    finally:
        gate.close()


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_store_client_reaches_the_store_through_a_tunnel_and_the_gate(gated_store):
    import torch.distributed as dist

    store, gate = gated_store
    tunnel = AuthTunnel(gate.address, SECRET, connect_timeout_s=10.0).start()
    try:
        client = dist.TCPStore("127.0.0.1", tunnel.address[1], is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("from-rank-1", b"hello")
        assert store.get("from-rank-1") == b"hello"
        store.set("from-rank-0", b"back")
        assert client.get("from-rank-0") == b"back"
        assert gate.admitted >= 1 and gate.refused == 0
    finally:
        tunnel.close()


def test_clients_without_the_secret_are_refused_and_the_store_is_untouched(gated_store):
    import torch.distributed as dist

    store, gate = gated_store
    store.set("kept", b"value")
    keys_before = store.num_keys()

    # A raw client sending garbage is cut off.
    with socket.create_connection(gate.address, timeout=10) as stray:
        assert stray.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL).startswith(MAGIC)
        _send_quietly(stray, os.urandom(4096))
        assert _closed_by_peer(stray)
    # torch's own store client, pointed at the gate, cannot write a key.
    with pytest.raises(Exception):
        client = dist.TCPStore("127.0.0.1", gate.address[1], is_master=False, timeout=datetime.timedelta(seconds=3))
        client.set("injected", b"x")
    # A tunnel holding another secret.
    wrong = AuthTunnel(gate.address, OTHER_SECRET, connect_timeout_s=5.0).start()
    try:
        with pytest.raises(Exception):
            client = dist.TCPStore("127.0.0.1", wrong.address[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=3))
            client.set("injected", b"x")
    finally:
        wrong.close()
    _wait_for(lambda: gate.refused >= 3)
    assert gate.admitted == 0
    assert not store.check(["injected"])
    assert store.num_keys() == keys_before and store.get("kept") == b"value"


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_rank_holding_another_secret_fails_at_once(gated_store):
    """torch's store client would retry a refused connection until its timeout (the group's, 600 s by default);
    the rank gives up at the first refusal, saying why."""
    from radixserve.model_runner.rendezvous import meet

    _, gate = gated_store
    started = time.monotonic()
    with pytest.raises(HandshakeError, match="same secret"):
        meet(f"127.0.0.1:{gate.address[1]}", rank=1, world_size=2, timeout_s=10.0, secret=OTHER_SECRET)
    assert time.monotonic() - started < 5.0


def test_the_gate_bounds_pending_handshakes(gated_store):
    """Connections that never speak take a handshake slot each until the deadline; past the bound, new ones are
    closed at once instead of piling up threads (the gate accepts in order, so the bound is reached by then)."""
    from radixserve.model_runner import dist_auth

    _, gate = gated_store
    idle = []
    try:
        for _ in range(dist_auth.MAX_PENDING_HANDSHAKES):
            idle.append(socket.create_connection(gate.address, timeout=10))
        started = time.monotonic()
        with socket.create_connection(gate.address, timeout=10) as extra:
            assert _closed_by_peer(extra) and extra.recv(1) == b""
        assert time.monotonic() - started < 1.0  # not the 2 s handshake deadline
        assert gate.refused >= 1
    finally:
        for sock in idle:
            sock.close()


def test_a_tunnel_waits_for_a_gate_that_starts_later():
    """Worker nodes may start before node 0: the tunnel retries until the gate listens."""
    import torch.distributed as dist

    port = _free_port()
    tunnel = AuthTunnel(("127.0.0.1", port), SECRET, connect_timeout_s=20.0).start()
    store_listener = listen("127.0.0.1", 0)
    host, store_port = store_listener.getsockname()[:2]
    results = {}

    def late_node_zero() -> None:
        time.sleep(1.0)
        results["store"] = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=30),
                                         master_listen_fd=store_listener.detach())
        results["gate"] = AuthGate(listen("127.0.0.1", port), (host, store_port), SECRET).start()

    starter = threading.Thread(target=late_node_zero, daemon=True)
    starter.start()
    try:
        client = dist.TCPStore("127.0.0.1", tunnel.address[1], is_master=False,
                               timeout=datetime.timedelta(seconds=20))
        client.set("late", b"yes")
        starter.join(timeout=10)
        assert results["store"].get("late") == b"yes"
    finally:
        tunnel.close()
        starter.join(timeout=10)
        if "gate" in results:
            results["gate"].close()


# ---- the secret at start ------------------------------------------------------------------------------------------

def _secret_file(folder, content: bytes = SECRET, mode: int = 0o600) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "dist-secret"
    path.write_bytes(content + b"\n")
    path.chmod(mode)
    return str(path)


def test_nnodes_above_one_without_a_secret_is_refused_naming_the_flag(monkeypatch):
    from radixserve.runtime.wire.server_args import ServerArgs

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="--dist-auth-secret-file"):
        ServerArgs(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500")


def test_the_secret_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    from radixserve.runtime.wire.server_args import ServerArgs

    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = _secret_file(tmp_path)
    args = ServerArgs(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500", dist_auth_secret_file=path)
    assert load_dist_secret(args.dist_auth_secret_file) == SECRET
    assert SECRET.decode() not in repr(args.to_dict())  # only the path is kept
    monkeypatch.setenv(SECRET_ENV, OTHER_SECRET.decode())
    ServerArgs(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500")
    assert load_dist_secret(None) == OTHER_SECRET
    assert load_dist_secret(path) == SECRET  # the flag wins over the environment


@pytest.mark.parametrize("defect, message", [
    ("readable by others", "mode 644"),
    ("short", f"needs at least {MIN_SECRET_BYTES}"),
    ("symbolic link", "cannot be opened"),
    ("missing", "cannot be opened"),
    ("folder", "not a regular file"),
])
def test_a_bad_secret_file_is_refused_naming_its_defect(tmp_path, monkeypatch, defect, message):
    from radixserve.runtime.wire.server_args import ServerArgs

    monkeypatch.delenv(SECRET_ENV, raising=False)
    if defect == "readable by others":
        path = _secret_file(tmp_path, mode=0o644)
    elif defect == "short":
        path = _secret_file(tmp_path, content=b"short")
    elif defect == "symbolic link":
        path = str(tmp_path / "link")
        os.symlink(_secret_file(tmp_path), path)
    elif defect == "missing":
        path = str(tmp_path / "absent")
    else:
        path = str(tmp_path)
    with pytest.raises(ValueError, match=message):
        ServerArgs(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500", dist_auth_secret_file=path)


def test_the_cli_refuses_a_worker_node_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--tp-size", "2", "--nnodes", "2",
                           "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29500"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "--dist-auth-secret-file" in done.stderr and SECRET_ENV in done.stderr


def test_a_rendezvous_off_loopback_without_a_secret_is_refused():
    from radixserve.model_runner.rendezvous import meet

    with pytest.raises(ValueError, match="not a loopback address"):
        meet("192.0.2.1:29500", rank=1, world_size=2, timeout_s=5.0, secret=None)


# ---- real servers -------------------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _listening(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of these processes and their descendants."""
    import psutil

    processes = []
    for pid in pids:
        process = psutil.Process(pid)
        processes += [process, *process.children(recursive=True)]
    found = []
    for process in processes:
        for conn in process.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port, process.pid))
    return found


def _poke(address: tuple[str, int], payload: bytes) -> None:
    """Connect, send `payload`, close: what a stray client does."""
    host = "127.0.0.1" if address[0] in ("0.0.0.0", "::") else address[0]
    with socket.create_connection((host, address[1]), timeout=5) as stray:
        _send_quietly(stray, payload)


@pytest.mark.slow
def test_one_host_tp2_listens_on_loopback_only_and_survives_stray_clients(tiny_model_dir):
    """TP=2 on the CPU: every TCP port of the scheduler ranks is on 127.0.0.1 (the store's and gloo's). Garbage sent
    to each of them (and a connection that just closes) leaves the group serving the same greedy ids."""
    from radixserve import Engine

    model = tiny_model_dir("qwen2", with_tokenizer=True, num_key_value_heads=1)
    with Engine(model_path=model, dtype="float32", device="cpu", tp_size=2, max_running_requests=8) as engine:
        before = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
        ports = _listening(engine._resources.children.pids().values())
        assert len({pid for _, _, pid in ports}) == 2, f"both ranks listen (the store, gloo): {ports}"
        assert {address for address, _, _ in ports} <= {"127.0.0.1"}, ports
        for address, port, _ in ports:
            _poke((address, port), os.urandom(4096))
            _poke((address, port), b"")
        time.sleep(1.0)
        after = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
        assert engine.is_healthy()
    assert after == before


def _store_client_refused(address: tuple[str, int]) -> bool:
    import torch.distributed as dist

    try:
        dist.TCPStore(address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=3)).set("x", b"y")
    except Exception:
        return True
    return False


@pytest.mark.slow
def test_two_nodes_refuse_clients_without_the_secret_and_serve_on(tiny_model_dir, tmp_path):
    """Node 0 (this process's Engine, rank 0) and node 1 (`radixserve serve --node-rank 1`, rank 1) meet at a
    loopback address with the secret (tests/parallel/test_tensor_parallel.py checks their ids against TP=1). A raw
    client sending garbage, one sending 1 MiB, torch's store client, a handshake with another secret and a whole
    worker node holding another secret are each refused at the rendezvous port; the group serves the same ids
    afterwards."""
    from radixserve import Engine

    secret_file = _secret_file(tmp_path)
    model = tiny_model_dir("qwen2", with_tokenizer=True, num_key_value_heads=1)
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    common = {"model_path": model, "dtype": "float32", "device": "cpu"}
    worker_command = [sys.executable, "-m", "radixserve", "serve", "--model-path", model, "--dtype", "float32",
                      "--device", "cpu", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                      "--dist-auth-secret-file", secret_file]
    worker_env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    worker = subprocess.Popen(worker_command, env=worker_env)
    try:
        with Engine(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, dist_auth_secret_file=secret_file,
                    **common) as engine:
            two_nodes = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
            # The store itself is on loopback at a port the kernel picked, never at the configured address.
            ports = _listening(engine._resources.children.pids().values())
            assert ("127.0.0.1", port) in {(address, p) for address, p, _ in ports}
            assert {address for address, _, _ in ports} <= {"127.0.0.1"}, ports
            _poke(("127.0.0.1", port), os.urandom(64))
            _poke(("127.0.0.1", port), os.urandom(1 << 20))
            assert _store_client_refused(("127.0.0.1", port))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as impostor:
                with pytest.raises(HandshakeError):
                    tunnel_handshake(impostor, OTHER_SECRET)
            # A whole worker node holding another secret fails to join, saying why.
            stray_node = subprocess.run(worker_command[:-1] + [_secret_file(tmp_path / "other", OTHER_SECRET)],
                                        capture_output=True, text=True, timeout=180, env=worker_env)
            assert stray_node.returncode != 0 and "same secret" in stray_node.stderr, stray_node.stderr[-2000:]
            after = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
            assert engine.is_healthy()
        assert worker.wait(timeout=60) != 0  # its group ended with node 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert after == two_nodes
