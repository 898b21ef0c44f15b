"""The detokenizer process: PULL scheduler_to_detokenizer, PUSH detokenizer_to_tokenizer.

BatchTokenOut becomes BatchTextOut; every other message (the scheduler's ProcessReady/ProcessFailed, RPC
replies) is forwarded byte for byte, so the TokenizerManager has a single socket to read.
"""

from __future__ import annotations

import logging
import sys
import traceback

import zmq

from radixserve.runtime.wire.heap import settle_heap
from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime.wire.messages import BatchTokenOut, ProcessFailed, ProcessReady, decode, encode
from radixserve.runtime.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_detokenizer_process(server_args: ServerArgs, ipc: IpcPaths, parent_pid: int) -> None:
    """Process entry. Reports ProcessReady, or ProcessFailed with the traceback and exits 1."""
    ctx = zmq.Context()
    sender = make_push(ctx, ipc.detokenizer_to_tokenizer)
    try:
        from radixserve.detokenizer_manager.manager import DetokenizerManager
        from radixserve.runtime.wire.tokenizer_files import server_tokenizer

        tokenizer_path = server_args.tokenizer_path
        if tokenizer_path is None:  # the launch resolves it (runtime/launch.py, resolve_for_launch)
            raise ValueError("the detokenizer needs the resolved tokenizer_path")
        manager = DetokenizerManager(server_tokenizer(tokenizer_path, server_args))
        receiver = make_pull(ctx, ipc.scheduler_to_detokenizer)
    except Exception:
        sender.send(encode(ProcessFailed(process="detokenizer", error=traceback.format_exc())))
        sender.close()  # lingers until the report is delivered
        sys.exit(1)
    # Start-up objects stay out of the collections that run while requests stream (runtime/wire/heap.py).
    settle_heap(server_args.gc_threshold, server_args.gc_warning_threshold_secs)
    sender.send(encode(ProcessReady(process="detokenizer")))
    logger.info("detokenizer ready (tokenizer %s)", tokenizer_path)

    while True:
        data = receiver.recv()
        message = decode(data)
        if isinstance(message, BatchTokenOut):
            sender.send(encode(manager.handle(message)))
        else:
            sender.send(data)
