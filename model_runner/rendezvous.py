"""Where the ranks of a tensor-parallel group meet, and which interface their collectives listen on.

The rendezvous is torch's TCPStore, hosted by rank 0. torch's `tcp://` init method would make the store listen on
every interface; here rank 0 binds the listening socket itself and hands it to the store, so it listens only where
asked:

- one host, no secret: on `--dist-init-addr` (a free port of 127.0.0.1 by default), which must be a loopback
  address: a store that other hosts can reach must authenticate them.
- with the group's secret (required across hosts; runtime/wire/dist_secret.py): the store listens on a port of
  127.0.0.1 the kernel picks, an `AuthGate` (model_runner/dist_auth.py) listens on `--dist-init-addr`, and every
  other rank reaches the store through an `AuthTunnel` of its own process, so no byte reaches the store from a
  connection that did not prove it holds the secret.

gloo's listeners (the model's and the relay's groups on the CPU) are bound to one interface while the groups are
made: loopback on one host; across hosts the interface this host reaches `--dist-init-addr` through, unless
GLOO_SOCKET_IFNAME names the interfaces already. NCCL picks its own (NCCL_SOCKET_IFNAME): it fixes the choice once
per process, and a weight-update group may need another interface towards a trainer.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch.distributed as dist

from radixserve.model_runner.dist_auth import AuthGate, AuthTunnel, listen

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"  # torch reads it when it makes a gloo group
_REFUSAL_POLL_S = 0.1


@dataclass
class Rendezvous:
    """This rank's store, and the forwarder it runs (rank 0: the gate; another rank: its tunnel; none without a
    secret)."""

    store: dist.Store
    gate: Optional[AuthGate] = None
    tunnel: Optional[AuthTunnel] = None

    def close(self) -> None:
        for forwarder in (self.gate, self.tunnel):
            if forwarder is not None:
                forwarder.close()


def split_host_port(addr: str) -> tuple[str, int]:
    """("host", port) of "host:port" ("[v6 address]:port" too)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror as error:
        raise ValueError(f"dist_init_addr host {host!r} does not resolve: {error}") from None
    return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def meet(init_addr: str, rank: int, world_size: int, timeout_s: float, secret: Optional[bytes]) -> Rendezvous:
    """Host (rank 0) or reach (other ranks) the group's store at `init_addr`; with `secret`, through the
    authenticated forwarders. ValueError for a store off loopback without a secret."""
    host, port = split_host_port(init_addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    if secret is None:
        if not is_loopback(host):
            raise ValueError(f"dist_init_addr {init_addr} is not a loopback address, so other hosts could reach the "
                             "group's rendezvous: give the group a secret (--dist-auth-secret-file) to authenticate "
                             "them, or leave dist_init_addr unset on one host")
        if rank == 0:
            return Rendezvous(_host_store(listen(host, port), world_size, timeout))
        return Rendezvous(dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout))
    if rank == 0:
        store_listener = listen("127.0.0.1", 0)
        gate = AuthGate(listen(host, port), store_listener.getsockname()[:2], secret).start()
        try:
            return Rendezvous(_host_store(store_listener, world_size, timeout), gate=gate)
        except BaseException:
            gate.close()
            raise
    tunnel = AuthTunnel((host, port), secret, connect_timeout_s=timeout_s).start()
    try:
        return Rendezvous(_reach_store(tunnel, world_size, timeout), tunnel=tunnel)
    except BaseException:
        tunnel.close()
        raise


def _reach_store(tunnel: AuthTunnel, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """torch's store client through `tunnel`. torch's client retries a refused connection until its timeout, so it
    runs on a thread of its own while this one raises the tunnel's HandshakeError as soon as the gate refuses this
    node's secret (the thread, blocked in torch, ends with the process)."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore("127.0.0.1", tunnel.address[1], world_size, is_master=False,
                                             timeout=timeout)
        except BaseException as error:  # raised again on the joining thread
            outcome["error"] = error
        done.set()

    threading.Thread(target=connect, name="radixserve-rendezvous-join", daemon=True).start()
    while not done.wait(_REFUSAL_POLL_S):
        if tunnel.refusal is not None:
            raise tunnel.refusal
    if "error" in outcome:
        raise outcome["error"]
    return outcome["store"]


def _host_store(listener: socket.socket, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store, serving on `listener` (which it takes over); returns once every rank has connected."""
    host, port = listener.getsockname()[:2]
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


@contextlib.contextmanager
def gloo_bound_to(init_addr: str, multi_node: bool) -> Iterator[None]:
    """Inside the block, the gloo groups this process makes listen on one interface: loopback on one host, else the
    one this host reaches `init_addr` through; an operator's GLOO_SOCKET_IFNAME wins across hosts."""
    if multi_node and os.environ.get(GLOO_INTERFACE_ENV):
        yield
        return
    host, port = split_host_port(init_addr)
    interface = interface_of("127.0.0.1" if not multi_node else local_address_towards(host, port))
    saved = os.environ.get(GLOO_INTERFACE_ENV)
    os.environ[GLOO_INTERFACE_ENV] = interface
    try:
        yield
    finally:
        if saved is None:
            del os.environ[GLOO_INTERFACE_ENV]
        else:
            os.environ[GLOO_INTERFACE_ENV] = saved


def local_address_towards(host: str, port: int) -> str:
    """The address of this host that the kernel would send from to reach `host` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address`; ValueError naming the address when none does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    raise ValueError(f"no network interface holds {address}, the address this host reaches the group's "
                     f"rendezvous from; name the collectives' interface with {GLOO_INTERFACE_ENV}")
