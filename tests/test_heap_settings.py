"""The collector settings of the serving processes (runtime/wire/heap.py), checked in a fresh interpreter."""

import subprocess
import sys

SCRIPT = """
import gc
from radixserve.runtime.wire.heap import YOUNG_THRESHOLD, settle_heap
loaded = [[i] for i in range(1000)]  # made before start-up ends: frozen
middle, old = gc.get_threshold()[1:]
settle_heap()
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old), gc.get_threshold()
assert all(not any(o is x for x in gc.get_objects()) for o in loaded[:3])  # out of the generations
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


def test_settle_heap_freezes_start_up_and_raises_the_young_threshold():
    completed = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stdout + completed.stderr
