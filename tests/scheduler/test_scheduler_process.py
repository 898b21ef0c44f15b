"""The scheduler process over real ZMQ sockets: ready report, request flow, RPCs, start-up failure, and
exit when its parent dies. The test plays the TokenizerManager (sender) and the DetokenizerManager (receiver).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import psutil
import pytest
import zmq

from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime.wire.messages import (
    BatchTokenOut, FlushCacheReq, FlushCacheReqOutput, GetServerInfoReq, GetServerInfoReqOutput, ProcessFailed,
    ProcessReady, SamplingParams, TokenizedGenerateReq, decode, encode,
)
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.process import run_scheduler_process
from test_scheduler import hf_greedy, make_prompts

START_TIMEOUT_S = 120


class Peer:
    """Sockets of the scheduler's two neighbours."""

    def __init__(self, ipc: IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.inbox = make_pull(self.ctx, ipc.scheduler_to_detokenizer)
        self.outbox = make_push(self.ctx, ipc.tokenizer_to_scheduler)

    def send(self, message) -> None:
        self.outbox.send(encode(message))

    def recv(self, timeout_s: float):
        if not self.inbox.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the scheduler")
        return decode(self.inbox.recv())

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()


def start(server_args: ServerArgs) -> tuple[mp.Process, Peer, IpcPaths]:
    ipc = IpcPaths.create()
    peer = Peer(ipc)
    process = mp.get_context("spawn").Process(
        target=run_scheduler_process, args=(server_args, ipc, os.getpid()), daemon=True
    )
    process.start()
    return process, peer, ipc


def test_requests_and_rpcs_over_zmq(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(20, 3, 512, 5, 30)
    expected = hf_greedy(model_dir, prompts, 6)
    process, peer, ipc = start(ServerArgs(model_path=model_dir, device="cpu", log_level="warning"))
    try:
        ready = peer.recv(START_TIMEOUT_S)
        assert isinstance(ready, ProcessReady) and ready.process == "scheduler"
        model = ready.model
        assert model.max_total_num_tokens > 0 and model.max_running_requests > 0 and model.context_len > 0
        assert model.vocab_size > 0 and model.page_size == 1 and model.device == "cpu"
        for i, prompt in enumerate(prompts):
            peer.send(TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, stream=i == 0,
                                           sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0)))
        outputs: dict[str, list[int]] = {}
        finished = set()
        while len(finished) < len(prompts):
            message = peer.recv(30)
            assert isinstance(message, BatchTokenOut)
            for rid, new, reason in zip(message.rids, message.new_token_ids, message.finish_reasons):
                assert rid not in finished
                outputs.setdefault(rid, []).extend(new)
                if reason is not None:
                    finished.add(rid)
        assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected

        peer.send(GetServerInfoReq(rpc_id="info-1"))
        info = peer.recv(30)
        assert isinstance(info, GetServerInfoReqOutput) and info.rpc_id == "info-1"
        memory = info.info.memory  # the typed report (runtime/wire/server_info.py) crosses the socket
        assert memory.free_tokens + memory.evictable_tokens == memory.total_tokens
        peer.send(FlushCacheReq(rpc_id="flush-1"))
        flushed = peer.recv(30)
        assert isinstance(flushed, FlushCacheReqOutput) and flushed.rpc_id == "flush-1" and flushed.success
        assert process.is_alive()
    finally:
        process.kill()
        process.join(10)
        peer.close()
        ipc.remove()


def test_start_up_failure_is_reported(tmp_path):
    process, peer, ipc = start(ServerArgs(model_path=str(tmp_path / "no-such-model"), device="cpu",
                                          log_level="critical"))
    try:
        failed = peer.recv(START_TIMEOUT_S)
        assert isinstance(failed, ProcessFailed) and failed.process == "scheduler"
        assert "no-such-model" in failed.error and "Traceback" in failed.error
        process.join(30)
        assert process.exitcode == 1
    finally:
        if process.is_alive():
            process.kill()
        peer.close()
        ipc.remove()


def _short_lived_parent(server_args: ServerArgs, ipc: IpcPaths, pid_queue) -> None:
    """Start a scheduler, wait until it is ready, report its pid, then die without any clean-up."""
    peer = Peer(ipc)
    child = mp.get_context("spawn").Process(
        target=run_scheduler_process, args=(server_args, ipc, os.getpid()), daemon=True
    )
    child.start()
    ready = peer.recv(START_TIMEOUT_S)
    pid_queue.put((child.pid, isinstance(ready, ProcessReady)))
    pid_queue.close()
    pid_queue.join_thread()  # the queue's feeder thread must deliver before the hard exit
    os._exit(0)


def test_scheduler_exits_when_its_parent_dies(tiny_model_dir):
    ipc = IpcPaths.create()
    context = mp.get_context("spawn")
    pid_queue = context.Queue()
    server_args = ServerArgs(model_path=tiny_model_dir("llama"), device="cpu", log_level="critical")
    parent = context.Process(target=_short_lived_parent, args=(server_args, ipc, pid_queue))
    parent.start()
    child_pid, was_ready = pid_queue.get(timeout=START_TIMEOUT_S)
    assert was_ready
    parent.join(30)
    try:
        child = psutil.Process(child_pid)
        child.wait(timeout=20)  # the watchdog polls the parent every 0.5 s
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        psutil.Process(child_pid).kill()
        pytest.fail("the scheduler outlived its parent")
    finally:
        ipc.remove()
