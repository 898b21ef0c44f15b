"""The data-parallel controller process: one PULL for requests, one PUSH per replica.

Generate requests go to one replica (policy.py); aborts, flushes, server-info and cache-tree requests go to
every replica, and the TokenizerManager gathers their replies (replies and outputs travel from the replicas to
the one DetokenizerManager, never through here). Replicas report their load and evictions (ReplicaLoad) on
the controller's second PULL. Messages are forwarded as the bytes that came in.

The controller holds no request state beyond counters, so it never blocks a replica: a replica that dies takes
the whole server down through the parent's supervisor, as any child does.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Optional

import zmq

from radixserve.runtime.data_parallel.policy import LoadBalancer, LoadEstimate
from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime.wire.messages import (
    ProcessFailed, ProcessReady, ReplicaLoad, TokenizedGenerateReq, decode, encode, request_tokens,
)
from radixserve.runtime.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)

PROCESS_NAME = "dp-controller"


class DataParallelController:
    def __init__(self, server_args: ServerArgs, replicas: list[zmq.Socket]) -> None:
        self.replicas = replicas
        self.balancer = LoadBalancer(
            server_args.load_balance_method, len(replicas), server_args.dp_cache_threshold,
            server_args.dp_balance_abs_threshold, server_args.dp_balance_rel_threshold,
        )
        self.sent = [0] * len(replicas)
        self.sent_tokens = [0] * len(replicas)
        self.reports: list[Optional[ReplicaLoad]] = [None] * len(replicas)

    def loads(self) -> list[LoadEstimate]:
        """Each replica's outstanding requests and tokens: its last report plus what was sent since."""
        out = []
        for r, report in enumerate(self.reports):
            if report is None:
                out.append(LoadEstimate(self.sent[r], self.sent_tokens[r]))
                continue
            in_transit = self.sent[r] - report.received
            in_transit_tokens = self.sent_tokens[r] - report.received_tokens
            out.append(LoadEstimate(in_transit + report.running + report.waiting,
                                    in_transit_tokens + report.outstanding_tokens))
        return out

    def handle_request(self, data: bytes) -> None:
        message = decode(data)
        if isinstance(message, TokenizedGenerateReq):
            if message.routed_dp_rank is not None:  # the caller chose (e.g. sglang-router --dp-aware)
                replica = message.routed_dp_rank
                self.balancer.chosen(message.namespace, message.input_ids, replica)
            else:
                replica = self.balancer.choose(message.namespace, message.input_ids, self.loads())
            self.sent[replica] += 1
            self.sent_tokens[replica] += request_tokens(message)
            self.replicas[replica].send(data)
        else:  # control messages: every replica answers (or ignores an abort of a request it does not hold)
            for socket in self.replicas:
                socket.send(data)

    def handle_report(self, data: bytes) -> None:
        report = decode(data)
        if not isinstance(report, ReplicaLoad):
            logger.warning("the data-parallel controller ignores a %s report", type(report).__name__)
            return
        if report.flushed:
            self.balancer.flushed(report.dp_rank)
        for evicted in report.evicted:
            self.balancer.evicted(report.dp_rank, evicted.namespace, evicted.tokens, evicted.kept)
        self.reports[report.dp_rank] = report


def run_dp_controller(server_args: ServerArgs, ipc: IpcPaths, parent_pid: int) -> None:
    """Process entry point (see runtime/launch.py)."""
    ctx = zmq.Context()
    status = make_push(ctx, ipc.detokenizer_to_tokenizer)  # start-up reports go straight to the parent
    try:
        requests = make_pull(ctx, ipc.tokenizer_to_scheduler)
        reports = make_pull(ctx, ipc.replica_reports)
        replicas = [make_push(ctx, ipc.replica_input(r)) for r in range(server_args.dp_size)]
        controller = DataParallelController(server_args, replicas)
    except BaseException:
        logger.exception("the data-parallel controller failed to start")
        status.send(encode(ProcessFailed(process=PROCESS_NAME, error=traceback.format_exc())))
        status.close()
        sys.exit(1)
    status.send(encode(ProcessReady(process=PROCESS_NAME)))
    logger.info("data-parallel controller ready: %d replicas, %s", server_args.dp_size,
                server_args.load_balance_method)
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    poller.register(reports, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        # Reports first: a request routed now should see the freshest loads and evictions.
        if reports in ready:
            _drain(reports, controller.handle_report)
        if requests in ready:
            _drain(requests, controller.handle_request)


def _drain(socket: zmq.Socket, handle) -> None:  # type: ignore[no-untyped-def]
    while True:
        try:
            data = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(data)
