"""`Runtime`: a radixserve server started from a script (SGLang's `sgl.Runtime`).

    import radixserve as sgl
    runtime = sgl.Runtime(model_path=None, max_running_requests=16)   # ServerArgs fields; None: embedded model
    sgl.set_default_backend(runtime)                                   # programs run on runtime.endpoint
    print(runtime.url)                                                 # http://127.0.0.1:30000 (or the next free port)
    ...
    runtime.shutdown()                                                 # also at interpreter exit

The server is `python -m radixserve serve` with the flags of the given server arguments, in a child process
whose output goes to this process's stdout/stderr (log_level defaults to "error", as in SGLang). The
arguments are checked here first (ValueError for unknown or invalid ones, before anything starts). As in
SGLang, the port is the first free one from `port` (30000 by default) upwards. The constructor returns once
`/health_generate` answers (the model is loaded and generates); RuntimeError if the server exits first,
TimeoutError after `launch_timeout` seconds.

The server stops with `shutdown()`, when the Runtime is garbage collected, and at interpreter exit; and, when
the Runtime was made on the main thread (Linux), also if this process dies without running its exit handlers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, AsyncIterator, Optional, Union

import httpx

from radixserve.frontend.backends.base import StreamDeltas
from radixserve.frontend.backends.runtime_endpoint import RuntimeEndpoint
from radixserve.runtime.wire.server_args import ServerArgs, make_server_args  # the wire: no torch, no FastAPI

_LAST_PORT = 40000  # the port search goes up to here (or 1000 ports on from the one asked for)
_POLL_INTERVAL_S = 0.5
_STOP_MARGIN_S = 15.0  # beyond the server's graceful_shutdown_timeout, before it is killed
_PR_SET_PDEATHSIG = 1


class Runtime:
    """A radixserve HTTP server in a child process (see the module docstring). `url`, `generate_url` and
    `endpoint` (a RuntimeEndpoint with the server's api_key) are ready once the constructor returns."""

    def __init__(self, model_path: Optional[str] = None, log_level: str = "error", launch_timeout: float = 300.0,
                 **server_args: Any):
        args = make_server_args(model_path, log_level=log_level, **server_args)
        self.server_args: ServerArgs = dataclasses.replace(args, port=_first_free_port(args.host, args.port))
        command = [sys.executable, "-m", "radixserve", "serve", *cli_flags(self.server_args)]
        self.url = f"http://{_client_host(self.server_args.host)}:{self.server_args.port}"
        self.generate_url = self.url + "/generate"
        self._headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        on_main_thread = threading.current_thread() is threading.main_thread()
        self._process: Optional[subprocess.Popen] = subprocess.Popen(
            command, preexec_fn=_die_with_parent if on_main_thread and sys.platform == "linux" else None)
        self.pid = self._process.pid
        self._finalizer = weakref.finalize(self, _stop, self._process,
                                           self.server_args.graceful_shutdown_timeout + _STOP_MARGIN_S)
        try:
            self._wait_ready(launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=args.api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(headers=self._headers, timeout=30.0) as client:
            while time.monotonic() < deadline:
                exitcode = self._process.poll()
                if exitcode is not None:
                    raise RuntimeError(f"the server exited with code {exitcode} while starting; see its log above")
                try:
                    if client.get(self.url + "/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(_POLL_INTERVAL_S)
        raise TimeoutError(f"the server did not become ready within {timeout} s")

    def shutdown(self) -> None:
        """Stop the server (SIGTERM; killed if it has not exited after its drain time). Idempotent."""
        self._finalizer()
        self.pid = None

    # ---- SGLang's Runtime helpers ----------------------------------------------------------------

    def cache_prefix(self, prefix: str) -> None:
        """Prefill `prefix` into the radix cache."""
        self.endpoint.prefill(prefix)

    def get_tokenizer(self) -> Any:
        return self.endpoint.tokenizer

    @property
    def token_usage(self) -> Any:
        """The endpoint's count of prompt and completion tokens (`reset()` to start again)."""
        return self.endpoint.token_usage

    def generate(self, prompt: Union[str, list[str]], sampling_params: Optional[dict] = None,
                 return_logprob: Union[bool, list[bool]] = False, logprob_start_len: Any = None,
                 top_logprobs_num: Any = None) -> str:
        """One native `/generate` request; its JSON answer as a string (as SGLang's Runtime returns it)."""
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        body = {key: value for key, value in body.items() if value is not None}
        with httpx.Client(headers=self._headers, timeout=None) as client:
            response = client.post(self.generate_url, json=body)
        return json.dumps(response.json())

    async def async_generate(self, prompt: str, sampling_params: Optional[dict] = None) -> AsyncIterator[str]:
        """Stream one completion of `prompt`: yields the new text of each chunk."""
        deltas = StreamDeltas(self.endpoint.streams_incrementally())
        body = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        async with httpx.AsyncClient(headers=self._headers, timeout=None) as client:
            async with client.stream("POST", self.generate_url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RuntimeError(str(chunk["error"]))
                    text = deltas(chunk)["text"]
                    if text:
                        yield text

    add_request = async_generate

    async def get_server_info(self) -> dict[str, Any]:
        """`/get_server_info` (a coroutine, as in SGLang's Runtime)."""
        async with httpx.AsyncClient(headers=self._headers, timeout=30.0) as client:
            response = await client.get(self.url + "/get_server_info")
        if response.status_code != 200:
            raise RuntimeError(f"failed to get the server info: HTTP {response.status_code}: {response.text}")
        return response.json()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runtime(url={self.url!r}, pid={self.pid})"


def cli_flags(server_args: ServerArgs) -> list[str]:
    """The `radixserve serve` flags that give `server_args` (the fields that differ from their defaults).
    ValueError for a value the command line cannot express (a flag that can only turn a setting on)."""
    flags: list[str] = []
    for field in dataclasses.fields(ServerArgs):
        value, default = getattr(server_args, field.name), field.default
        if value == default and type(value) is type(default):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool) or isinstance(default, bool):
            if value is not True or default is True:
                raise ValueError(f"{field.name}={value!r} cannot be passed to `radixserve serve` (its flag {flag} "
                                 f"only turns the setting on); leave it at its default")
            flags.append(flag)
        elif value is None:
            raise ValueError(f"{field.name}=None cannot be passed to `radixserve serve`; leave it at its default")
        else:
            flags += [flag, str(value)]
    return flags


def _first_free_port(host: str, start: int) -> int:
    for port in range(start, min(65536, max(_LAST_PORT, start + 1000))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} from {start}")


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, host)


def _die_with_parent() -> None:
    # Only used from the main thread: PR_SET_PDEATHSIG fires when the *thread* that started the child exits.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
