"""The collector settings of the serving processes (runtime/wire/heap.py, SGLang's --gc-threshold and
--gc-warning-threshold-secs), checked in fresh interpreters."""

import subprocess
import sys

import pytest

from radixserve.runtime.wire.server_args import ServerArgs

DEFAULTS = """
import gc
from radixserve.runtime.wire.heap import YOUNG_THRESHOLD, settle_heap
loaded = [[i] for i in range(1000)]  # made before start-up ends: frozen
middle, old = gc.get_threshold()[1:]
settle_heap()
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old), gc.get_threshold()
live = {id(o) for o in gc.get_objects()}
assert not any(id(o) in live for o in loaded), "frozen objects are in no generation"
# Cycles made afterwards are still collected.
class Node:
    pass
for _ in range(100):
    a, b = Node(), Node()
    a.peer, b.peer = b, a
del a, b
assert gc.collect() >= 200
print("ok")
"""

GIVEN = """
import gc, logging
from radixserve.runtime.wire.heap import settle_heap
logging.basicConfig(level=logging.WARNING, format="%(message)s")
old = gc.get_threshold()[2]
settle_heap([900, 7], warning_secs=1e-9)
assert gc.get_threshold() == (900, 7, old), gc.get_threshold()
gc.collect()
print("ok")
"""


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_settle_heap_freezes_start_up_and_raises_the_young_threshold():
    completed = run(DEFAULTS)
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stdout + completed.stderr
    assert "long garbage collection" not in completed.stderr  # no warning unless asked for


def test_given_thresholds_replace_from_generation_0_and_long_collections_are_logged():
    completed = run(GIVEN)
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stdout + completed.stderr
    assert "long garbage collection: generation 2 took" in completed.stderr


def test_server_args_take_sglang_gc_flags():
    args = ServerArgs(gc_threshold=["50000", "20", 30], gc_warning_threshold_secs=0.5)
    assert args.gc_threshold == [50000, 20, 30] and args.gc_warning_threshold_secs == 0.5
    for bad in ([], [1, 2, 3, 4], [-1], ["x"], [1.5], [True], "700"):
        with pytest.raises(ValueError, match="gc_threshold"):
            ServerArgs(gc_threshold=bad)
    with pytest.raises(ValueError, match="gc_warning_threshold_secs"):
        ServerArgs(gc_warning_threshold_secs=-1.0)
