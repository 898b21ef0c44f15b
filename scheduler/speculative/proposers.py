"""Where drafts come from: the request's own text (NGRAM), or a small draft model (STANDALONE).

A proposer answers `propose(reqs, budgets)` with up to `budgets[i]` draft tokens per request, is told how each
verify step ended (`settle`), and drops what it keeps for a request when the request leaves the running batch
(`release`: finished, aborted or retracted).
"""

from __future__ import annotations

from typing import Protocol

from radixserve.radix_cache.base import PrefixCache
from radixserve.scheduler.req import Req


class Proposer(Protocol):
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Draft tokens to follow each request's last token: at most `budgets[i]` for request i (its chain's
        longest allowed length), fewer where the proposer expects them to be rejected."""

    def settle(self, req: Req, num_before: int, num_taken: int, num_accepted: int) -> None:
        """The request had `num_before` tokens (prompt + outputs) before the verify step, took `num_taken` tokens
        in it, `num_accepted` of them accepted drafts."""

    def release(self, req: Req) -> None:
        """Forget the request (it left the running batch)."""

    def check_idle(self) -> None:
        """Assert that nothing is held for any request (the scheduler is idle)."""

    def flush(self) -> None:
        """Drop what is cached across requests (the scheduler's cache was flushed)."""


class NgramProposer:
    """Drafts from tokens already seen; holds no memory.

    First the radix tree: when another request of the same namespace ran through exactly this request's tokens,
    what it produced next (radix_cache/continuation.py; the tree holds only verified tokens of finished requests
    and computed prompts), up to the whole budget. Otherwise prompt lookup over the request's own tokens
    (scheduler/speculative/ngram.py), as many drafts as the match's length warrants (`SpecState.ngram_draft_len`).
    """

    def __init__(self, min_window: int, max_window: int, cache: PrefixCache) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.cache = cache
        self.num_from_tree = 0  # proposals taken from the tree

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = []
        for req, budget in zip(reqs, budgets):
            all_ids = req.all_ids
            from_tree = self.cache.continuation(all_ids, req.namespace, budget)
            if from_tree:
                self.num_from_tree += 1
                drafts.append(from_tree)
                continue
            state = req.spec
            state.index.extend_to(all_ids)
            match_len, start = state.index.longest_match(self.min_window, self.max_window)
            drafts.append(state.index.continuation(start, min(budget, state.ngram_draft_len(match_len))))
        return drafts

    def settle(self, req: Req, num_before: int, num_taken: int, num_accepted: int) -> None:
        pass

    def release(self, req: Req) -> None:
        pass

    def check_idle(self) -> None:
        pass

    def flush(self) -> None:
        pass
