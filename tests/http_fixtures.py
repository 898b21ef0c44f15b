"""A real `python -m radixserve serve` process for the HTTP tests.

`shared_server(name)` starts one server per configuration and pytest session (start-up costs seconds on a
small CPU machine, so several test modules share it) and stops it with SIGTERM at exit; the shutdown test,
which runs last in name order, takes it over with `take_shared_server` and stops it itself. Servers die with the
test process (PR_SET_PDEATHSIG), so an interrupted run leaves no server behind.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

KEY_A, KEY_B, ADMIN_KEY = "sk-tenant-alpha", "sk-tenant-beta", "sk-admin"
STARTUP_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1


# The suite's servers keep the column-panel linear off, as the scheduler tests' runners do (tests/scheduler_driver.py):
# a request's float32 sums then do not depend on how many rows its batch has (the small-row kernel's up to 16 rows
# each sum alone), which tests comparing one request's output across batchings (streamed or not, n > 1) rely on.
SUITE_CPU_KERNELS = "auto,-panel"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    def __init__(self, *flags: str, api_key: Optional[str] = None, admin_key: Optional[str] = None,
                 wait: bool = True, command: tuple[str, ...] = ("-m", "radixserve", "serve")) -> None:
        """Start the server (`python <command> --port P <flags>`); with `wait` (the default) return once /health
        answers, else call wait_healthy()."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.admin_key = admin_key
        self.log = tempfile.NamedTemporaryFile(prefix="radixserve-http-test-", suffix=".log", delete=False)
        if command[-1] == "serve" and "--cpu-kernels" not in flags:
            flags = (*flags, "--cpu-kernels", SUITE_CPU_KERNELS)
        self.process = subprocess.Popen([sys.executable, *command, "--port", str(self.port), *flags], stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent)
        if wait:
            self.wait_healthy()

    def headers(self, key: Optional[str] = None) -> dict[str, str]:
        key = key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()[-5000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_text()[-5000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; returns the exit code (kills it if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode == 0 and os.path.exists(self.log.name):
            os.unlink(self.log.name)  # kept only when something went wrong
        return self.process.returncode

    def server_info(self) -> dict:
        """The administrator's view (the whole server)."""
        response = httpx.get(self.url + "/get_server_info", headers=self.headers(self.admin_key), timeout=30.0)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll until no request runs or waits and no KV slot is held; returns the last server info."""
        deadline = time.monotonic() + timeout
        info = self.server_info()
        while time.monotonic() < deadline:
            memory = info["memory"]
            if (info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
                    and memory["free_tokens"] + memory["evictable_tokens"] == memory["total_tokens"]
                    and info["http"]["inflight_engine_requests"] == 0):
                return info
            time.sleep(0.05)
            info = self.server_info()
        raise AssertionError(f"server not idle after {timeout} s: {info}")


_servers: dict[str, ServerProcess] = {}


def tenants_file() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="radixserve-tenants-"), "tenants.json")
    with open(path, "w") as f:
        json.dump({KEY_A: "alpha", KEY_B: "beta"}, f)
    return path


MAIN_SERVER_FLAGS = ("--max-running-requests", "8", "--max-queued-requests", "4", "--graceful-shutdown-timeout", "4",
                     "--log-level", "warning")


def shared_server(name: str = "main") -> ServerProcess:
    """The session's server: "main" has tenants A and B (KEY_A / KEY_B) and an administrator (ADMIN_KEY), room
    for 8 + 4 requests, and drains for 4 s on SIGTERM."""
    if name not in _servers:
        if name != "main":
            raise ValueError(name)
        _servers[name] = ServerProcess(*MAIN_SERVER_FLAGS, "--tenants-file", tenants_file(),
                                       "--admin-api-key", ADMIN_KEY, api_key=KEY_A, admin_key=ADMIN_KEY)
    return _servers[name]


def take_shared_server(name: str = "main") -> ServerProcess:
    """The shared server, handed over to a caller that will stop it (later users get a fresh one)."""
    server = shared_server(name)
    del _servers[name]
    return server


@atexit.register
def _stop_all() -> None:
    for server in _servers.values():
        server.stop()
