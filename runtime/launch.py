"""Starting, watching and stopping the scheduler and detokenizer processes.

Lifecycle of one launch (the Engine drives it):

    ipc = IpcPaths.create()
    child_args = resolve_for_launch(server_args)   # resolve/convert the model once, in the parent
    children = ChildProcesses(child_args, ipc)
    children.start()                               # spawn; each child gets the parent's pid
    infos = children.wait_ready(pull_socket)       # ProcessReady from both, or EngineStartupError
    children.start_supervisor(on_death)            # on_death(name, exitcode) if one dies unexpectedly
    ...
    children.stop()                                # terminate, join, kill leftovers (idempotent)

Children die with the parent: each polls its parent pid (see `watch_parent`). PR_SET_PDEATHSIG is not used
because it fires when the *thread* that spawned the child exits, and an Engine may be built from a short-lived
thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import zmq

from radixserve.runtime.import_path import drop_checkout_from_sys_path
from radixserve.runtime.wire.ipc import IpcPaths
from radixserve.runtime.wire.messages import ModelInfo, ProcessFailed, ProcessReady, decode
from radixserve.runtime.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)

ChildEntry = Callable[[ServerArgs, IpcPaths, int], None]
PARENT_POLL_INTERVAL_S = 0.5


class EngineStartupError(RuntimeError):
    """A child process failed to start; the message holds its traceback when it could report one."""


# ---- inside a child ------------------------------------------------------------------------------


def watch_parent(parent_pid: int, interval_s: float = PARENT_POLL_INTERVAL_S) -> threading.Thread:
    """Exit this process (os._exit) soon after `parent_pid` is gone; runs on a daemon thread."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="radixserve-parent-watch", daemon=True)
    thread.start()
    return thread


def _child_main(name: str, entry: ChildEntry, server_args: ServerArgs, ipc: IpcPaths, parent_pid: int) -> None:
    """What every child runs first: die with the parent, leave Ctrl-C to the parent, log with its name, and keep
    the checkout's folders out of bare imports (a spawned child copies the parent's `sys.path`)."""
    drop_checkout_from_sys_path()
    watch_parent(parent_pid)
    # A terminal's Ctrl-C reaches the whole process group; the parent handles it and stops the children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format=f"%(asctime)s [{name} %(process)d] %(levelname)s %(name)s: %(message)s",
    )
    _use_thread_lock_for_tqdm()
    entry(server_args, ipc, parent_pid)


def _use_thread_lock_for_tqdm() -> None:
    """Progress bars in a child (weight loading) would otherwise create a multiprocessing semaphore, which a
    terminated child cannot release: the resource tracker then warns about a leak at the parent's exit."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


# ---- in the parent -------------------------------------------------------------------------------


def resolve_for_launch(server_args: ServerArgs) -> ServerArgs:
    """Resolve (and for a GGUF, convert once) the model, and a speculative draft model, in the parent, before any
    child starts.

    Returns the arguments the children get: tokenizer_path filled in with the resolved Hugging Face directory
    when it was None, so the detokenizer loads the tokenizer without resolving again.
    """
    from radixserve.runtime.model_files import resolve_model

    resolved = resolve_model(server_args.model_path, server_args.load_format, server_args.model_cache_dir)
    if server_args.speculative_draft_model_path is not None:  # the draft's runner only locates its files
        resolve_model(server_args.speculative_draft_model_path, "auto", server_args.model_cache_dir)
    if server_args.tp_size > 1 and server_args.dist_init_addr is None:
        server_args = dataclasses.replace(server_args, dist_init_addr=f"127.0.0.1:{_free_port()}")
    if server_args.tokenizer_path is not None:
        return server_args
    return dataclasses.replace(server_args, tokenizer_path=resolved.model_dir)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawn children without re-running the caller's __main__ in them.

    `spawn` normally re-imports the parent's main script in each child, so a script that builds an Engine at
    top level (no `if __name__ == "__main__":` guard) would recursively start engines. The children run only
    radixserve functions, so they do not need the main module: hide its file and spec while starting them.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    had_spec = "__spec__" in saved
    try:
        main.__spec__ = None
        if "__file__" in saved:
            del main.__file__
        yield
    finally:
        if not had_spec:
            del main.__spec__
        for name, value in saved.items():
            setattr(main, name, value)


def scheduler_entries(server_args: ServerArgs, dp_rank: Optional[int] = None) -> dict[str, ChildEntry]:
    """This node's scheduler processes, one per tensor-parallel rank it hosts: "scheduler" is rank 0,
    "scheduler-tp{r}" rank r (in data-parallel replica i: "scheduler-dp{i}", "scheduler-dp{i}-tp{r}"). Node k
    of `nnodes` hosts ranks `[k * tp/nnodes, (k+1) * tp/nnodes)`."""
    import functools

    from radixserve.scheduler.process import run_scheduler_process, scheduler_process_name

    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    entries: dict[str, ChildEntry] = {}
    for rank in range(first, first + per_node):
        entry = functools.partial(run_scheduler_process, tp_rank=rank, dp_rank=dp_rank)
        entries[scheduler_process_name(rank, dp_rank)] = entry
    return entries


def _default_entries(server_args: ServerArgs) -> dict[str, ChildEntry]:
    """The schedulers of node 0 (all of them on one host), the detokenizer, and with `dp_size > 1` the
    data-parallel controller in front of the replicas."""
    if server_args.node_rank != 0:
        raise ValueError(f"node_rank {server_args.node_rank} hosts tensor-parallel ranks only: start it with "
                         "`radixserve serve --node-rank K ...`; the server and the Engine run on node 0")
    from radixserve.detokenizer_manager.process import run_detokenizer_process

    if server_args.dp_size == 1:
        return {**scheduler_entries(server_args), "detokenizer": run_detokenizer_process}
    import functools

    from radixserve.runtime.data_parallel.controller import PROCESS_NAME, run_dp_controller

    entries: dict[str, ChildEntry] = {PROCESS_NAME: run_dp_controller}
    for dp_rank in range(server_args.dp_size):
        replica_args = server_args
        if server_args.tp_size > 1:  # each replica's TP group meets at its own address
            replica_args = dataclasses.replace(server_args, dist_init_addr=f"127.0.0.1:{_free_port()}")
        for name, entry in scheduler_entries(replica_args, dp_rank).items():
            entries[name] = functools.partial(_with_args, replica_args, entry)
    entries["detokenizer"] = run_detokenizer_process
    return entries


def _with_args(replica_args: ServerArgs, entry: ChildEntry, server_args: ServerArgs, ipc: IpcPaths,
               parent_pid: int) -> None:
    """Run `entry` with its replica's arguments instead of the launch's."""
    entry(replica_args, ipc, parent_pid)


def primary_model_info(infos: dict[str, Optional[ModelInfo]], server_args: ServerArgs) -> ModelInfo:
    """The scheduler's ModelInfo (data-parallel: replica 0's, with the smallest KV pool and request limit of
    all replicas, so a request admitted by the TokenizerManager fits any of them)."""
    import msgspec

    if server_args.dp_size == 1:
        return infos["scheduler"]
    replicas = [infos[f"scheduler-dp{r}"] for r in range(server_args.dp_size)]
    return msgspec.structs.replace(
        replicas[0], dp_size=server_args.dp_size,
        max_total_num_tokens=min(info.max_total_num_tokens for info in replicas),
        max_running_requests=min(info.max_running_requests for info in replicas))


class ChildProcesses:
    """The scheduler and detokenizer processes of one launch.

    `entries` maps a process name to the function it runs (default: the real scheduler and detokenizer);
    each is called as entry(server_args, ipc, parent_pid).
    """

    def __init__(self, server_args: ServerArgs, ipc: IpcPaths, entries: Optional[dict[str, ChildEntry]] = None):
        self.server_args = server_args
        self.ipc = ipc
        self.entries = entries or _default_entries(server_args)
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self._stopping = threading.Event()
        self._supervisor: Optional[threading.Thread] = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        with _main_module_hidden():
            self._start_all(ctx)

    def _start_all(self, ctx: Any) -> None:
        for name, entry in self.entries.items():
            process = ctx.Process(
                target=_child_main,
                args=(name, entry, self.server_args, self.ipc, os.getpid()),
                name=f"radixserve-{name}",
                daemon=True,
            )
            process.start()
            self.processes[name] = process

    def pids(self) -> dict[str, Optional[int]]:
        return {name: process.pid for name, process in self.processes.items()}

    def all_alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes.values())

    def wait_ready(self, socket: zmq.Socket, timeout_s: float = 600.0) -> dict[str, Optional[ModelInfo]]:
        """Read start-up reports from `socket` (the parent's PULL) until every child is ready.

        Returns {process name: ProcessReady.model} (the scheduler's ModelInfo). Raises EngineStartupError with the child's traceback on
        ProcessFailed, if a child dies without reporting, or after `timeout_s`.
        """
        infos: dict[str, Optional[ModelInfo]] = {}
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        first_death: Optional[float] = None
        while len(infos) < len(self.processes):
            if poller.poll(100):
                message = decode(socket.recv())
                if isinstance(message, ProcessFailed):
                    raise EngineStartupError(f"the {message.process} process failed to start:\n{message.error}")
                if isinstance(message, ProcessReady):
                    infos[message.process] = message.model
                    logger.info("%s process ready", message.process)
                else:
                    logger.warning("ignoring %s received during start-up", type(message).__name__)
                continue
            now = time.monotonic()
            dead = [name for name, p in self.processes.items() if not p.is_alive()]
            if dead:
                first_death = first_death or now
                # A scheduler's failure report travels through the detokenizer, which forwards it only once
                # it is up itself: give it that long before reporting a death without a traceback.
                relay_pending = "detokenizer" not in infos and "detokenizer" not in dead
                if now - first_death > (30.0 if relay_pending else 2.0):
                    codes = ", ".join(f"{n} (exit code {self.processes[n].exitcode})" for n in dead)
                    raise EngineStartupError(f"child process exited during start-up without a report: {codes}")
            if now > deadline:
                missing = sorted(set(self.processes) - set(infos))
                raise EngineStartupError(f"timed out after {timeout_s:.0f} s waiting for {missing} to start")
        return infos

    def start_supervisor(self, on_death: Callable[[str, Optional[int]], None]) -> None:
        """Call on_death(name, exitcode) once, from a daemon thread, when a child dies before stop()."""

        def run() -> None:
            by_sentinel = {p.sentinel: name for name, p in self.processes.items()}
            while not self._stopping.is_set():
                ready = multiprocessing.connection.wait(list(by_sentinel), timeout=0.2)
                if ready and not self._stopping.is_set():
                    name = by_sentinel[ready[0]]
                    process = self.processes[name]
                    process.join(timeout=1.0)  # reap it so exitcode is known
                    on_death(name, process.exitcode)
                    return

        self._supervisor = threading.Thread(target=run, name="radixserve-supervisor", daemon=True)
        self._supervisor.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the children and everything they started; kill what does not exit in time. Idempotent."""
        self._stopping.set()
        import psutil

        descendants: list[psutil.Process] = []  # e.g. tensor-parallel workers; they also watch their parent
        for process in self.processes.values():
            if process.pid is not None and process.is_alive():
                try:
                    descendants.extend(psutil.Process(process.pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        for victim in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.terminate()
        deadline = time.monotonic() + timeout_s
        for name, process in self.processes.items():
            if process.pid is None:
                continue
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("killing the %s process (pid %d): it ignored SIGTERM", name, process.pid)
                process.kill()
                process.join(timeout=timeout_s)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
        for victim in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=1.0)
