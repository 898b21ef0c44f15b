"""Speculative decoding: draft proposals (n-gram), verify batches, acceptance, and KV settlement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from radixserve.scheduler.speculative.speculator import Speculator


class NoSpeculation:
    """The speculator of a scheduler without speculative decoding: it plans no verify step, keeps no state and
    reports nothing, so the scheduler calls the same methods either way."""

    enabled = False
    num_accepted = 0

    def plan(self, reqs: list) -> None:
        return None

    def new_state(self) -> None:
        return None

    def release(self, req: Any) -> None:
        pass

    def check_idle(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def info(self) -> dict:
        return {}


def make_speculator(args, runner, cache, stop_checker) -> Union["Speculator", NoSpeculation]:
    """The Speculator for `args.speculative_algorithm`, or NoSpeculation when speculative decoding is off."""
    if args.speculative_algorithm is None:
        return NoSpeculation()
    from radixserve.scheduler.speculative.speculator import Speculator

    return Speculator(args, runner, cache, stop_checker)


__all__ = ["NoSpeculation", "make_speculator"]
