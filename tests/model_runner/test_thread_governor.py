"""The CPU thread governor's choices (model_runner/cpu/thread_governor.py) on scripted step times: a machine whose
forward step costs depend on the thread count and on whether a busy neighbour shares the cores, as measured on a
2-core VM (benchmarks/cpu_busy_neighbour.sh: 25 ms with two threads and 30 ms with one when quiet; 800 ms with two
and 32 ms with one beside one busy loop). The governor must keep two threads while quiet, drop to one within a few
steps of the neighbour starting, come back after it stops, and pay little for its probes either way."""

import pytest
import torch

from radixserve.model_runner.cpu.thread_governor import MAX_INTERVAL, ThreadGovernor

QUIET = {2: 0.025, 1: 0.030}
BUSY = {2: 0.800, 1: 0.032}


class Machine:
    """A clock that advances, during each step, by the step's cost for the thread count the governor chose."""

    def __init__(self) -> None:
        self.now = 0.0
        self.costs = QUIET
        self.threads = 2
        self.history: list[int] = []

    def clock(self) -> float:
        return self.now

    def set_threads(self, n: int) -> None:
        self.threads = n

    def run(self, governor: ThreadGovernor, steps: int, num_tokens: int = 1) -> float:
        start = self.now
        for _ in range(steps):
            with governor.step(num_tokens) as threads:
                assert threads == self.threads
                self.now += self.costs[threads] * (1 + 0.01 * (len(self.history) % 3))  # a little noise
            self.history.append(threads)
        return (self.now - start) / steps


@pytest.fixture
def machine():
    return Machine()


def test_quiet_machine_keeps_every_thread_and_probes_rarely(machine):
    governor = ThreadGovernor(2, set_threads=machine.set_threads, clock=machine.clock)
    mean = machine.run(governor, 5000)
    assert governor.threads == 2 and governor.moves == 0
    assert machine.history[-1000:].count(1) <= 2 * 2  # at most two probes of two steps in the last 1000 steps
    assert mean < QUIET[2] * 1.02


def test_busy_neighbour_moves_to_one_thread_and_back(machine):
    governor = ThreadGovernor(2, set_threads=machine.set_threads, clock=machine.clock)
    machine.run(governor, 200)
    machine.costs = BUSY
    first = len(machine.history)
    machine.run(governor, 10)
    assert governor.threads == 1, machine.history[first:]
    assert machine.history[first:].count(2) <= 5  # the slow steps before the probe that moves
    mean = machine.run(governor, 5000)
    assert mean < 1.5 * BUSY[1]  # the probes back to two threads back off: within 3x of the quiet step and far less
    machine.costs = QUIET
    machine.run(governor, MAX_INTERVAL + 10)
    assert governor.threads == 2


def test_a_probe_interrupted_by_another_step_size_is_retried(machine):
    governor = ThreadGovernor(2, set_threads=machine.set_threads, clock=machine.clock)
    machine.run(governor, 100)
    machine.costs = BUSY
    for _ in range(40):  # decode steps and prefills alternate: each bucket keeps its own recent times
        machine.run(governor, 1, num_tokens=1)
        machine.run(governor, 1, num_tokens=100)
    assert governor.threads == 1


def test_one_thread_never_probes(machine):
    calls = []
    governor = ThreadGovernor(1, set_threads=calls.append, clock=machine.clock)
    machine.threads = 1
    machine.run(governor, 3000)
    assert calls == [] and governor.probes == 0


def test_torch_thread_count_follows_the_governor():
    """The real setter: a step runs with torch's thread count set to the governor's choice, in the calling thread."""
    before = torch.get_num_threads()
    try:
        governor = ThreadGovernor(2)
        governor.threads = 1
        governor._applied = 2
        with governor.step(1) as threads:
            assert threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
