"""N-gram proposals: draft tokens copied from where the request's own text already continued its current tail.

Prompt lookup: find the latest earlier place in `prompt + outputs` whose preceding tokens equal the sequence's
last `n` tokens (the longest `n` in `[min_window, max_window]` that occurs), and propose the tokens that followed
it there. Code edits, quotes and summaries repeat long spans of their input, so these guesses are often right;
a wrong guess costs only verify compute, never correctness (the target model checks every draft).

`TokenIndex` keeps, per request, the positions of every token value, appended to as outputs arrive, so a
proposal looks only at the places where the last token occurred before (most recent first, at most
`MAX_CANDIDATES` of them) instead of scanning the whole sequence.
"""

from __future__ import annotations

from typing import Sequence

# Earlier occurrences of the last token examined per proposal, most recent first.
MAX_CANDIDATES = 64


class TokenIndex:
    """Positions of each token value in a growing sequence (the request's prompt and outputs)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}

    def extend_to(self, all_ids: Sequence[int]) -> None:
        """Index `all_ids`, which must start with the tokens indexed so far."""
        for position in range(len(self.tokens), len(all_ids)):
            token = all_ids[position]
            self.tokens.append(token)
            self.positions.setdefault(token, []).append(position)

    def longest_match(self, min_window: int, max_window: int) -> tuple[int, int]:
        """`(n, start)`: the longest suffix of at least `min_window` and at most `max_window` tokens that occurred
        earlier, `n` its length and `start` the position after its latest earlier occurrence (what followed
        it there); `(0, -1)` when there is none."""
        tokens = self.tokens
        end = len(tokens)
        if end < 2:
            return 0, -1
        best_len, best_start = 0, -1
        occurrences = self.positions.get(tokens[-1], [])
        # The last occurrence is the tail itself; examine the ones before it, latest first.
        for checked, position in enumerate(reversed(occurrences[:-1])):
            if checked >= MAX_CANDIDATES:
                break
            length = 1
            while (length < max_window and position - length >= 0
                   and tokens[position - length] == tokens[end - 1 - length]):
                length += 1
            if length > best_len:
                best_len, best_start = length, position + 1
                if length == max_window:
                    break
        if best_len < min_window:
            return 0, -1
        return best_len, best_start

    def continuation(self, start: int, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens from `start` on (proposals may run into the tail itself: a repeating loop)."""
        return self.tokens[start: start + max_drafts] if max_drafts > 0 and start >= 0 else []
