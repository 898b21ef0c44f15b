"""Speculative decoding: draft proposals (n-gram), verify batches, acceptance, and KV settlement."""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)


def make_speculator(args, runner, cache, stop_checker) -> Optional["Speculator"]:
    """The Speculator for `args.speculative_algorithm`, or None when speculative decoding is off."""
    if args.speculative_algorithm is None:
        return None
    from radixserve.scheduler.speculative.speculator import Speculator

    if not args.disable_overlap_schedule:
        logger.info("speculative decoding runs without the overlap scheduler: a verify step's drafts come from "
                       "the tokens the previous step accepted, which overlap would not have on the host yet")
    return Speculator(args, runner, cache, stop_checker)
