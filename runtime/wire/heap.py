"""How the serving processes set up Python's cyclic garbage collector once they have started.

A serving process holds two kinds of objects: what start-up loaded (modules, the model, the app, the tokenizer),
which lives as long as the process, and what requests make. Two settings keep full collections, which stop the
process for as long as they walk every tracked object, out of the requests' way:

- the start-up heap is frozen, so no collection walks it again;
- a young collection runs after `YOUNG_THRESHOLD` net new tracked objects rather than CPython's 700 (2,000 from
  3.13). With the default, objects that live a few milliseconds (a step's outputs, a chunk on its way to a stream)
  survive two young collections, reach the oldest generation and trigger full collections every few seconds under
  a streaming load; with the higher threshold they are freed by reference counting first. Cycles are still found,
  by the same collections, run less often.

This module is light (no torch) so every process can import it.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def settle_heap() -> None:
    """Freeze what start-up made and raise the young generation's threshold; call once, when a process is ready."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
