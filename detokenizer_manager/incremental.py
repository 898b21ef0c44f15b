"""Incremental detokenization of one request's output, with stop-string trimming.

The text of a request is defined as `tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)` cut at the first occurrence of any stop string. `IncrementalDecoder`
produces that text as a sequence of deltas whose concatenation is exactly it, decoding only a short window of
recent tokens per step:

- Two offsets into the ids: `surr` (start of the window) and `read` (end of what has been turned into text).
  Each step decodes ids[surr:read] and ids[surr:]; the new text is the second minus the first. Decoding from
  `surr` rather than `read` gives the tokenizer the context it needs (e.g. SentencePiece's leading space).
- A step whose decoded window ends in U+FFFD is held back (the last token ended inside a multi-byte
  character); the offsets only advance when the window ends on a complete character, so every offset sits
  on a character boundary and concatenating windows equals decoding everything at once. On the final step
  everything is flushed, replacement characters included, just as a full decode would show them.
- Stop strings: text that might still become the start of a stop string is held back, so a delta never holds
  a partial stop string that a later token would cut. The first full occurrence ends the text.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best


class IncrementalDecoder:
    """Turns one request's output token ids, pushed in pieces, into safe text deltas."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0
        self.pending = ""  # decoded text not yet emitted (held back for a possible stop string)
        self.stopped = False  # a stop string was found: everything after it is dropped

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def push(self, new_ids: Sequence[int], finished: bool = False) -> str:
        """Append `new_ids` and return the text that is now safe to show (possibly "").

        With `finished=True` everything decoded is released (still cut at a stop string).
        """
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        if self.read_offset < len(self.ids):
            window_before = self._decode(self.ids[self.surr_offset : self.read_offset])
            window_now = self._decode(self.ids[self.surr_offset :])
            if finished or not window_now.endswith(REPLACEMENT_CHAR):
                self.pending += window_now[len(window_before) :]
                self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(finished)

    def _release(self, finished: bool) -> str:
        if self.stop:
            cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out, self.pending = self.pending[:cut], ""
                return out
        hold = 0 if finished else _longest_stop_prefix_suffix(self.pending, self.stop)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out
