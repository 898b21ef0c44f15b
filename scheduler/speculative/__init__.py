"""Speculative decoding: draft proposals (n-gram), verify batches, acceptance, and KV settlement."""

from __future__ import annotations

from typing import Optional


def make_speculator(args, runner, cache, stop_checker) -> Optional["Speculator"]:
    """The Speculator for `args.speculative_algorithm`, or None when speculative decoding is off."""
    if args.speculative_algorithm is None:
        return None
    from radixserve.scheduler.speculative.speculator import Speculator

    return Speculator(args, runner, cache, stop_checker)
