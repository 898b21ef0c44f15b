"""`--watchdog-timeout`: a real scheduler process whose step runs past the timeout logs what it was doing and
exits non-zero; rounds within the timeout, and idle waits longer than it, never trip the watchdog."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from radixserve.runtime.wire.messages import ProcessReady, SamplingParams, TokenizedGenerateReq
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.watchdog import EXIT_CODE, StepWatchdog
from http_fixtures import free_port
from test_scheduler_process import START_TIMEOUT_S, start

pytestmark = pytest.mark.timeout(300)


def test_only_a_round_past_the_timeout_fires():
    fired = threading.Event()
    codes: list[int] = []

    def exit(code: int) -> None:
        codes.append(code)
        fired.set()

    watchdog = StepWatchdog(0.2, lambda: "the state", exit=exit)
    watchdog.start()
    for _ in range(20):  # short rounds
        with watchdog.busy():
            time.sleep(0.02)
    time.sleep(0.6)  # idle: waiting between rounds is not work
    assert not fired.is_set()
    with watchdog.busy():
        assert fired.wait(5.0)
    assert codes == [EXIT_CODE] and EXIT_CODE != 0


def test_a_step_past_the_timeout_ends_the_scheduler_process(default_model_dir, capfd):
    # One unchunked prefill of 4,000 tokens takes far longer than 3 s on a CPU: a step past the timeout.
    server_args = ServerArgs(model_path=default_model_dir, device="cpu", chunked_prefill_size=-1,
                             watchdog_timeout=3.0, log_level="info")
    process, peer, ipc = start(server_args)
    try:
        assert isinstance(peer.recv(START_TIMEOUT_S), ProcessReady)
        time.sleep(2.0)  # idle polls (1 s each) do not count
        assert process.is_alive()
        peer.send(TokenizedGenerateReq(rid="stuck-prefill", input_ids=[(7 * i) % 5000 + 10 for i in range(4000)],
                                       sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0)))
        started = time.monotonic()
        process.join(60)
        elapsed = time.monotonic() - started
        assert process.exitcode == EXIT_CODE, process.exitcode
        assert 3.0 <= elapsed < 30, elapsed
    finally:
        if process.is_alive():
            process.kill()
        peer.close()
        ipc.remove()
    log = capfd.readouterr().err
    assert "watchdog: scheduler round" in log and "no progress" in log
    assert "stuck-prefill" in log  # the state names the request being computed
    assert "thread MainThread" in log and "run_scheduler_process" in log  # and the stacks show where it was


def _relay_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from radixserve.scheduler.loop import SocketInput
    from radixserve.scheduler.tp import TPInput, TPRelay

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    relay = TPRelay(rank, dist.new_group(backend="gloo"))
    if rank == 1:
        relay.exchange(None)  # one round together, then this rank is stuck (it never joins the next exchange)
        time.sleep(60)
        return
    context = zmq.Context.instance()
    receiver = context.socket(zmq.PULL)
    receiver.bind("inproc://messages")
    source = TPInput(relay, SocketInput(receiver))
    watchdog = StepWatchdog(1.0, lambda: "rank 0", exit=lambda code: results.put(("fired", code)))
    watchdog.start()
    source.receive(0, False, watchdog)
    results.put(("first round", None))
    started = time.monotonic()
    source.receive(0, False, watchdog)  # the broadcast blocks on the stuck peer: the watchdog must see it
    results.put(("returned", time.monotonic() - started))


def test_rank_zeros_end_of_the_relay_is_watched():
    """Rank 0 of a tensor-parallel group broadcasts each round's messages; gloo's root waits for every receiver,
    so a stuck peer blocks it there. That wait is work (the others are always waiting for rank 0), so the
    watchdog fires instead of the group hanging between rounds."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_relay_rank, args=(rank, port, results), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        assert results.get(timeout=120) == ("first round", None)
        assert results.get(timeout=30) == ("fired", EXIT_CODE)
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.slow
def test_a_stuck_tensor_parallel_rank_ends_the_group(tiny_model_dir, capfd):
    """`--tp-size 2 --watchdog-timeout 5`: rank 1 stops (SIGSTOP) mid-generation; rank 0's round waits in a
    collective past the timeout, its watchdog ends it, and the engine fails the pending request instead of
    hanging."""
    import os
    import signal

    from radixserve import Engine

    model = tiny_model_dir("llama", with_tokenizer=True)
    engine = Engine(model_path=model, device="cpu", dtype="float32", tp_size=2, watchdog_timeout=5.0,
                    max_running_requests=4, log_level="info")
    try:
        ranks = engine._resources.children.pids()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                while True:  # requests one after another until the group fails them
                    engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 400,
                                                                             "temperature": 0.0, "ignore_eos": True})
            except BaseException as error:  # the request must fail, not hang
                errors.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(2.0)
        os.kill(ranks["scheduler-tp1"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        thread.join(timeout=60.0)
        assert not thread.is_alive(), "the request still waits 60 s after a rank got stuck"
        assert errors and 5.0 <= time.monotonic() - stopped_at < 60.0
    finally:
        engine.shutdown()
    assert "watchdog: scheduler round" in capfd.readouterr().err
