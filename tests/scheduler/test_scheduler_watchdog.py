"""`--watchdog-timeout`: a real scheduler process whose step runs past the timeout logs what it was doing and
exits non-zero; rounds within the timeout, and idle waits longer than it, never trip the watchdog."""

from __future__ import annotations

import threading
import time

import pytest

from radixserve.runtime.wire.messages import ProcessReady, SamplingParams, TokenizedGenerateReq
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.watchdog import EXIT_CODE, StepWatchdog
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
