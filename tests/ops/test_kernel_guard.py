"""kernels/guard.py: a kernel that fails to build on this device is turned off once, with its reason logged; the
caller's own errors pass through and leave it on."""

from __future__ import annotations

import logging

import pytest

from radixserve.kernels.guard import KernelGuard


def call_through(guard: KernelGuard, kernel, fallback):
    """The caller's pattern: the kernel while usable, the fallback after it failed (and for this call)."""
    if guard.usable:
        try:
            return kernel()
        except Exception as exc:
            if not guard.absorb(exc):
                raise
    return fallback()


def test_a_failure_turns_the_kernel_off_and_is_logged_once(caplog):
    guard = KernelGuard("the test kernel", "the slow path serves")
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("PTX assembly failed")

    with caplog.at_level(logging.WARNING, logger="radixserve.kernels.guard"):
        assert [call_through(guard, broken, lambda: "slow") for _ in range(3)] == ["slow"] * 3
    assert calls == [1] and guard.usable is False
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the test kernel failed on this device (RuntimeError: PTX assembly failed); the slow path "
                        "serves instead"]


def test_the_callers_own_errors_pass_through_and_leave_it_on():
    guard = KernelGuard("the test kernel", "the slow path serves", errors_of_the_caller=(ValueError,))

    def refuses():
        raise ValueError("top_k larger than the experts")

    with pytest.raises(ValueError, match="top_k"):
        call_through(guard, refuses, lambda: "slow")
    assert guard.usable is True
    assert call_through(guard, lambda: "fast", lambda: "slow") == "fast"
