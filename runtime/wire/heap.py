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

SGLang's `--gc-threshold` replaces the thresholds (1 to 3 of them, from generation 0), and
`--gc-warning-threshold-secs` logs every collection that takes longer. This module is light (no torch) so every
process can import it.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 50_000


def settle_heap(thresholds: Optional[Sequence[int]] = None, warning_secs: float = 0.0) -> None:
    """Freeze what start-up made and set the collector's thresholds; call once, when a process is ready. The
    warning, when asked for, covers the full collection made here too."""
    if warning_secs > 0:
        gc.callbacks.append(LongCollectionWarning(warning_secs))
    gc.collect()
    gc.freeze()
    wanted = list(thresholds) if thresholds else [YOUNG_THRESHOLD]
    current = list(gc.get_threshold())
    current[: len(wanted)] = wanted
    gc.set_threshold(*current)


class LongCollectionWarning:
    """A `gc.callbacks` entry that logs a warning for each collection longer than `limit_secs`."""

    def __init__(self, limit_secs: float) -> None:
        self.limit_secs = limit_secs
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        if elapsed > self.limit_secs:
            logger.warning("long garbage collection: generation %d took %.3f s (over %.3f s), %d objects collected; "
                           "%d objects frozen at start-up", info["generation"], elapsed, self.limit_secs,
                           info["collected"], gc.get_freeze_count())


def parse_gc_threshold(value: Any) -> list[int]:
    """1 to 3 thresholds (generations 0, 1, 2), each an int >= 0 (given as ints or, from the command line, strings)."""
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(item, bool) or not isinstance(item, (int, str))
                                                  for item in value):
            raise TypeError
        thresholds = [int(item) for item in value]
    except (TypeError, ValueError):
        raise ValueError(f"gc_threshold must be 1 to 3 integers, got {value!r}") from None
    if not 1 <= len(thresholds) <= 3 or min(thresholds) < 0:
        raise ValueError(f"gc_threshold must be 1 to 3 integers >= 0, got {value!r}")
    return thresholds
