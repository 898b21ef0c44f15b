"""`--watchdog-timeout`: a real scheduler process whose step runs past the timeout logs what it was doing and
exits non-zero; an idle one (waiting for messages longer than the timeout) never trips it."""

from __future__ import annotations

import time

import pytest

from radixserve.runtime.messages import BatchTokenOut, ProcessReady, SamplingParams, TokenizedGenerateReq
from radixserve.runtime.server_args import ServerArgs
from radixserve.scheduler.watchdog import EXIT_CODE
from test_scheduler_process import START_TIMEOUT_S, start

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 0.3


def test_a_step_past_the_timeout_ends_the_scheduler(default_model_dir, capfd):
    # One unchunked prefill of 4,000 tokens takes seconds on the CPU: a step far past the timeout.
    server_args = ServerArgs(model_path=default_model_dir, device="cpu", chunked_prefill_size=-1,
                             watchdog_timeout=TIMEOUT_S, log_level="info")
    process, peer, ipc = start(server_args)
    try:
        assert isinstance(peer.recv(START_TIMEOUT_S), ProcessReady)
        # Idle for several timeouts (the idle loop waits 1 s per poll): nothing trips.
        peer.send(TokenizedGenerateReq(rid="short", input_ids=[1, 2, 3],
                                       sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)))
        assert isinstance(peer.recv(60), BatchTokenOut)
        time.sleep(8 * TIMEOUT_S)
        assert process.is_alive()

        peer.send(TokenizedGenerateReq(rid="stuck-prefill", input_ids=[(7 * i) % 5000 + 10 for i in range(4000)],
                                       sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0)))
        started = time.monotonic()
        process.join(60)
        elapsed = time.monotonic() - started
        assert process.exitcode == EXIT_CODE != 0, process.exitcode
        assert elapsed < 30, elapsed
    finally:
        if process.is_alive():
            process.kill()
        peer.close()
        ipc.remove()
    log = capfd.readouterr().err
    assert "watchdog: scheduler round" in log and "no progress" in log
    assert "stuck-prefill" in log  # the state names the request being computed
    assert "thread MainThread" in log  # and the stacks show where the loop was
