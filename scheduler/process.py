"""The scheduler process: ZMQ in, Scheduler steps, ZMQ out (the loop is loop.py's `serve`, on every rank).

    recv (block only when idle) -> handle messages -> step -> send outputs

Sockets (see runtime/ipc.py): PULL bound on `tokenizer_to_scheduler` (data-parallel replica i: on
`replica_input(i)`, fed by the controller, and a PUSH for its ReplicaLoad reports), PUSH connected to
`scheduler_to_detokenizer`. Start-up sends `ProcessReady(process="scheduler", model=...)` once the model is
loaded, or `ProcessFailed` with the traceback (then exits 1). The process dies with its parent: a watchdog
thread polls the parent pid and exits when the parent is gone (no PR_SET_PDEATHSIG: it fires when the parent
*thread* that spawned us exits, which kills the scheduler of an Engine created from a short-lived thread).
A second thread, the step watchdog (watchdog.py), exits with status 1 when one round of work makes no progress
for `--watchdog-timeout` seconds.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Optional

import zmq

from radixserve.runtime.wire.heap import settle_heap
from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime.wire.messages import ProcessFailed, ProcessReady, encode
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.loop import InputSource, SocketInput, serve
from radixserve.scheduler.watchdog import StepWatchdog, describe_scheduler

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def run_scheduler_process(server_args: ServerArgs, ipc: IpcPaths, parent_pid: int, tp_rank: int = 0,
                          dp_rank: Optional[int] = None) -> None:
    """Process entry point (multiprocessing `spawn` target). With tensor parallelism there is one per rank:
    rank 0 owns the input socket, the others take their input from it (scheduler/tp.py). `dp_rank`: the
    data-parallel replica this process belongs to (None without data parallelism)."""
    name = scheduler_process_name(tp_rank, dp_rank)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="%(asctime)s [scheduler] %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent(parent_pid)
    ctx = zmq.Context()
    input_url = ipc.tokenizer_to_scheduler if dp_rank is None else ipc.replica_input(dp_rank)
    receiver = make_pull(ctx, input_url) if tp_rank == 0 else None
    sender = make_push(ctx, ipc.scheduler_to_detokenizer)
    try:
        from radixserve.scheduler.scheduler import Scheduler

        runner = None
        if server_args.tp_size > 1 or dp_rank is not None:
            from radixserve.model_runner.model_runner import ModelRunner
            from radixserve.model_runner.runner_config import RunnerConfig

            runner = ModelRunner(RunnerConfig.from_server_args(server_args), tp_rank, dp_rank or 0)
        scheduler = Scheduler(server_args, model_runner=runner)
    except BaseException:
        logger.exception("scheduler failed to start")
        sender.send(encode(ProcessFailed(process=name, error=traceback.format_exc())))
        sender.close()  # lingers until the report is delivered (bounded by the socket's linger)
        sys.exit(1)

    # Everything loaded so far (modules, the model, the pools) lives as long as the process (runtime/wire/heap.py).
    settle_heap(server_args.gc_threshold, server_args.gc_warning_threshold_secs)
    sender.send(encode(ProcessReady(process=name, model=scheduler.ready_info())))
    logger.info("%s ready: %s", name, scheduler.ready_info())
    watchdog = StepWatchdog(server_args.watchdog_timeout, lambda: describe_scheduler(scheduler))
    reporter = None
    if dp_rank is not None and tp_rank == 0:
        from radixserve.scheduler.replica_report import ReplicaReporter

        reporter = ReplicaReporter(dp_rank, make_push(ctx, ipc.replica_reports), scheduler)
    try:
        watchdog.start()  # on every rank: a rank stuck in a step ends its process, and with it the group
        serve(scheduler, _input_source(scheduler, receiver, tp_rank), sender if tp_rank == 0 else None, watchdog,
              reporter)
    except BaseException:
        logger.exception("%s crashed", name)
        sender.send(encode(ProcessFailed(process=name, error=traceback.format_exc())))
        sender.close()
        os._exit(1)


def scheduler_process_name(tp_rank: int = 0, dp_rank: Optional[int] = None) -> str:
    """"scheduler" (TP rank 0), "scheduler-tp{r}"; under data parallelism "scheduler-dp{i}[-tp{r}]"."""
    name = "scheduler" if dp_rank is None else f"scheduler-dp{dp_rank}"
    return name if tp_rank == 0 else f"{name}-tp{tp_rank}"


def _input_source(scheduler, receiver: Optional[zmq.Socket], tp_rank: int) -> InputSource:
    """The socket (only rank 0 has one), relayed to every rank of a tensor-parallel group."""
    socket = SocketInput(receiver) if receiver is not None else None
    if scheduler.args.tp_size == 1:
        assert socket is not None
        return socket
    from radixserve.scheduler.tp import TPInput, TPRelay

    return TPInput(TPRelay(tp_rank, scheduler.runner.tp_cpu_group), socket)


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="radixserve-parent-watch", daemon=True).start()
