"""How many threads a CPU forward pass uses, chosen from measured step times.

Every intra-op parallel region (torch's OpenMP team, the project's C++ kernels) ends at a barrier that waits for its
slowest thread. With the cores to itself, the team spins briefly at each barrier and a region costs little. Beside
another busy process, one of the team's threads shares a core with it: the whole team waits for that thread's next
time slice at every barrier, hundreds of times per forward pass, and a decode step that takes 25 ms on a quiet 2-core
machine takes 800 ms beside one busy loop (benchmarks/cpu_busy_neighbour.sh). Spinning less (OMP_WAIT_POLICY=PASSIVE)
removes that loss everywhere but costs a third of the quiet step.

The governor keeps the whole team while it is the fastest and shrinks it when it is not. Now and then it runs a probe,
a step or two with one thread fewer (or, below the whole team, one more), and moves there when the probe is clearly
faster than the recent steps of the same size at the current count. A step far slower than the recent ones (a
neighbour just started) brings the next probe forward; a probe that loses doubles the wait before the next one, up to
`MAX_INTERVAL` steps, so a steady state pays almost nothing for the probes.

The project's small-row linear and attention kernels sum each output in one thread in a fixed order, so the thread
count does not change their bits (tests/ops/test_cpu_linear.py, test_cpu_attention.py); some library routes (torch's
own linear at a few rows, with `--cpu-kernels torch`) may differ in the last bits between thread counts, as every
route already may between batch shapes outside deterministic inference. The governor is not used where bits must not
move (deterministic inference) or where ranks step together (tensor parallelism).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

RECENT = 3  # steps of one size at the current count that a probe is compared with (their median)
PROBE_STEPS = 2  # steps a probe runs (the faster one counts), unless its first already lost clearly
PROBE_WIN = 0.9  # a probe moves the governor when it is at least 10% faster than the recent median
PROBE_LOST = 2.0  # a probe step this much slower than the recent median ends the probe at once
SLOW = 3.0  # a step this much slower than the recent median brings the next probe forward
SLOW_PROBE_DELAY = 2  # ... to this many steps later, once the slow steps fill the recent median
FIRST_INTERVAL = 32  # steps from a move (or the start) to the first probe
MAX_INTERVAL = 1024  # the longest wait between probes
PROBE_PATIENCE = 16  # steps of other sizes a probe waits through for the next step of its own size


@dataclass
class _Probe:
    threads: int
    bucket: int
    seconds: list[float] = field(default_factory=list)
    skipped: int = 0  # steps of other sizes run meanwhile


class ThreadGovernor:
    """Chooses the intra-op thread count of each forward step: `with governor.step(num_tokens): forward()`.

    Steps are compared by size: the bucket of a step is the bit length of its token count, so a decode step of 4
    requests is compared with decode steps of 4 to 7 requests, never with a prefill. Call `step` from the thread that
    runs the forward (torch's thread count is per thread under OpenMP).
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be positive, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads  # the count steps run with outside probes
        self.moves = 0
        self.probes = 0
        self._set_threads = set_threads
        self._clock = clock
        self._applied = max_threads
        self._recent: dict[int, deque[float]] = {}  # bucket -> the last step times at `threads`
        self._interval = FIRST_INTERVAL
        self._countdown = FIRST_INTERVAL
        self._probe_up = False  # below the whole team, probes alternate between one more and one fewer
        self._probe: _Probe | None = None

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[int]:
        """Runs the body with this step's thread count (yielded) and records how long it took."""
        bucket = max(num_tokens, 0).bit_length()
        threads = self._threads_for(bucket)
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads
        start = self._clock()
        yield threads
        self._record(bucket, threads, self._clock() - start)

    def _threads_for(self, bucket: int) -> int:
        probe = self._probe
        if probe is not None:
            if probe.bucket == bucket:
                return probe.threads
            probe.skipped += 1  # a step of another size runs as usual; the probe goes on at its own size's next step
            if probe.skipped <= PROBE_PATIENCE:
                return self.threads
            self._end_probe("abandoned")  # its size stopped coming: try again later
        self._countdown -= 1
        if self._countdown > 0 or len(self._recent.get(bucket, ())) < RECENT:
            return self.threads
        target = self._probe_target()
        if target is None:
            self._countdown = MAX_INTERVAL
            return self.threads
        self._probe = _Probe(target, bucket)
        self.probes += 1
        return target

    def _probe_target(self) -> int | None:
        if self.max_threads == 1:
            return None
        if self.threads == self.max_threads:
            return self.threads - 1
        if self.threads == 1:
            return 2
        self._probe_up = not self._probe_up
        return self.threads + 1 if self._probe_up else self.threads - 1

    def _record(self, bucket: int, threads: int, seconds: float) -> None:
        probe = self._probe
        if probe is not None and threads == probe.threads and bucket == probe.bucket:
            probe.seconds.append(seconds)
            baseline = statistics.median(self._recent[bucket])
            best = min(probe.seconds)
            if best < PROBE_WIN * baseline and len(probe.seconds) >= PROBE_STEPS:
                self.threads = probe.threads
                self._recent = {bucket: deque(probe.seconds, maxlen=RECENT)}
                self.moves += 1
                self._end_probe("moved")
            elif best > PROBE_LOST * baseline or len(probe.seconds) >= PROBE_STEPS:
                self._end_probe("lost")
            return
        recent = self._recent.setdefault(bucket, deque(maxlen=RECENT))
        if len(recent) == RECENT and seconds > SLOW * statistics.median(recent):
            self._countdown = min(self._countdown, SLOW_PROBE_DELAY + 1)
        recent.append(seconds)

    def _end_probe(self, outcome: str) -> None:
        self._probe = None
        if outcome == "moved":
            self._interval = FIRST_INTERVAL
        elif outcome == "lost":
            self._interval = min(2 * self._interval, MAX_INTERVAL)
        self._countdown = self._interval
