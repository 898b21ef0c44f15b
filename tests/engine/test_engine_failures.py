"""Failure handling of the Engine's processes: start-up errors, a child dying mid-generation, the parent dying.

Each test owns its Engine (they kill processes). Real scheduler and detokenizer on the default model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from radixserve import Engine, EngineDeadError, EngineStartupError


def our_children() -> set[int]:
    """Live descendants of this process, except multiprocessing's shared resource tracker."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(child.cmdline()):
                continue
            pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_bad_server_arguments_fail_before_any_process_starts():
    before = our_children()
    with pytest.raises(ValueError, match="unknown server argument"):
        Engine(not_an_argument=1)
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(schedule_policy="fastest")
    assert our_children() == before


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_child_start_up_failure_raises_with_its_traceback():
    before = our_children()
    started = time.monotonic()
    with pytest.raises(EngineStartupError) as failure:
        Engine(device="cuda", log_level="error")
    assert "scheduler" in str(failure.value) and "Traceback" in str(failure.value)
    assert time.monotonic() - started < 120
    assert our_children() == before, "a failed start must not leave children behind"


def test_killing_the_scheduler_fails_pending_calls_within_5s_and_shutdown_cleans_up():
    before = our_children()
    engine = Engine(log_level="error")
    pids = engine._resources.children.pids()
    assert set(pids.values()) <= our_children()
    params = {"max_new_tokens": 2000, "ignore_eos": True}
    stream = engine.generate("Write a very long story.", params, stream=True)
    next(stream)
    blocking_error: list[BaseException] = []

    def blocking_call() -> None:
        try:
            engine.generate("Another long story:", params)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            blocking_error.append(exc)

    thread = threading.Thread(target=blocking_call)
    thread.start()
    time.sleep(0.5)

    killed_at = time.monotonic()
    os.kill(pids["scheduler"], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="scheduler"):
        for _ in stream:
            pass
    thread.join(timeout=10)
    assert time.monotonic() - killed_at < 5.0
    assert not thread.is_alive() and isinstance(blocking_error[0], EngineDeadError)
    assert not engine.is_healthy()

    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        engine.generate("x", {"max_new_tokens": 1})
    with pytest.raises(EngineDeadError):
        engine.get_server_info()
    assert time.monotonic() - started < 1.0, "calls on a dead engine fail at once"

    ipc_dir = engine._resources.ipc.tmp_dir
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert all(gone(pid) for pid in pids.values())
    assert our_children() == before
    assert not os.path.exists(ipc_dir)
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.generate("x")


PARENT_SCRIPT = """
import json, os, signal
from radixserve import Engine
engine = Engine(log_level="error")
print(json.dumps(list(engine._resources.children.pids().values())), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_children_exit_when_the_parent_is_killed(tmp_path):
    # A script without the `if __name__ == "__main__":` guard must work: spawn must not re-run it in the children.
    script = tmp_path / "unguarded_script.py"
    script.write_text(PARENT_SCRIPT)
    process = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    pids = json.loads(process.stdout.strip().splitlines()[-1])
    assert len(pids) == 2
    deadline = time.monotonic() + 5.0
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "children outlived their parent"
        time.sleep(0.1)
