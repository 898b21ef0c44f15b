"""A tensor-parallel worker node: `radixserve serve --nnodes N --node-rank k` with k > 0.

Node 0 runs the whole server (HTTP, TokenizerManager, detokenizer) and the scheduler ranks of its share; every
other node runs only its share of scheduler ranks, `[k * tp/N, (k+1) * tp/N)`, launched with the same command
and its own `--node-rank`. The ranks meet at `--dist-init-addr`; rank 0 relays the inputs to all of them, so a
worker node has no socket to the server beyond the process group.

The worker node watches its ranks like the server does: readiness (or a start-up traceback) arrives on a local
socket; when any rank exits, the node stops the others and exits non-zero. A rank elsewhere that dies breaks
the group's collectives, which ends the ranks here too (and node 0's, which fails its pending requests).
"""

from __future__ import annotations

import logging
import multiprocessing.connection

import zmq

from radixserve.runtime.launch import ChildProcesses, EngineStartupError, resolve_for_launch, scheduler_entries
from radixserve.runtime.wire.ipc import IpcPaths, make_pull
from radixserve.runtime.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_worker_node(server_args: ServerArgs) -> int:
    """Run this node's scheduler ranks until one exits (or the process is terminated); the exit status."""
    assert server_args.node_rank > 0
    child_args = resolve_for_launch(server_args)
    ipc = IpcPaths.create()
    ctx = zmq.Context()
    ready_socket = make_pull(ctx, ipc.scheduler_to_detokenizer)  # where the ranks report readiness
    children = ChildProcesses(child_args, ipc, scheduler_entries(child_args))
    try:
        children.start()
        children.wait_ready(ready_socket)
        logger.info("tensor-parallel node %d ready: ranks %s", server_args.node_rank, sorted(children.processes))
        sentinels = {p.sentinel: name for name, p in children.processes.items()}
        ended = multiprocessing.connection.wait(list(sentinels))
        name = sentinels[ended[0]]
        logger.error("the %s process exited (exit code %s); stopping this node", name,
                     children.processes[name].exitcode)
        return 1
    except EngineStartupError as error:
        logger.error("%s", error)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        children.stop()
        ready_socket.close(linger=0)
        ctx.term()
        ipc.remove()
