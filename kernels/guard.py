"""A fast kernel with a slower path beside it, turned off for the process once it fails to build on this device.

Triton compiles a kernel on its first call, for the device it meets. A Triton build or a device that cannot compile
one (an FP8 conversion a GPU lacks, a PTX the driver refuses) should cost speed, not the server: the caller catches
the failure, the guard logs the reason once and answers `usable = False` from then on, and the caller takes its
slower path for this call and every later one. The first call happens in the runner's warm-up, before any CUDA graph
is captured; a failure during a capture is not absorbed (the graph would hold half a kernel), nor are the exception
types a caller names as its own errors (bad arguments are the caller's bug, not the device's).

    _guard = KernelGuard("the skinny FP8 kernel", "the FP8 GEMMs serve decode rows")
    ...
    if _guard.usable:
        try:
            return skinny(x, w)
        except Exception as exc:
            if not _guard.absorb(exc):
                raise
    return fallback(x, w)

Importing this module imports no Triton, so CPU-only processes may hold guards.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class KernelGuard:
    """Whether one kernel still serves in this process (`usable`); `absorb` decides a failure's fate."""

    def __init__(self, kernel: str, instead: str, errors_of_the_caller: tuple[type[BaseException], ...] = ()) -> None:
        self.kernel = kernel
        self.instead = instead
        self.errors_of_the_caller = errors_of_the_caller
        self.usable = True

    def absorb(self, exc: BaseException) -> bool:
        """True when `exc` is the kernel failing on this device: the guard turns the kernel off and logs why, once.
        False (the caller re-raises) for the caller's own errors and for anything raised during a CUDA graph
        capture."""
        if isinstance(exc, self.errors_of_the_caller) or _capturing():
            return False
        if self.usable:
            self.usable = False
            logger.warning("%s failed on this device (%s: %s); %s instead", self.kernel, type(exc).__name__, exc,
                           self.instead)
        return True


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
