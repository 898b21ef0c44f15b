"""Stop conditions, checked after each new output token.

In order: stop token ids and EOS (unless `ignore_eos`), stop strings, then `max_new_tokens`. While a request
is below `min_new_tokens` it does not stop on a token or a string; EOS and stop ids are also banned from
sampling then (`banned_token_ids`), so they cannot appear in the first place.

Stop strings are found by decoding the tail of the output ids, long enough to cover the longest stop string
even when every character takes several byte-level tokens, so a string split across tokens still stops.
Only text that the newest token completed counts: a match must end after the text of the tail without it.
The detokenizer trims the text at the string; the scheduler sends every generated token.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from radixserve.runtime.wire.messages import FinishReason
from radixserve.scheduler.req import Req

# Tokens decoded per character of the longest stop string (byte-level tokens can split one character
# into up to 4 UTF-8 bytes), plus slack for a token that starts before the string.
TOKENS_PER_STOP_CHAR = 4
TAIL_SLACK_TOKENS = 2


class StopChecker:
    """Decides whether a request finished after its latest token. `tokenizer` is only needed for stop strings."""

    def __init__(self, eos_token_ids: Sequence[int], tokenizer: Any = None) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer

    def banned_token_ids(self, req: Req, num_outputs_before: int) -> list[int]:
        """Ids to mask when sampling output number `num_outputs_before` (0-based) of `req`."""
        params = req.sampling_params
        if num_outputs_before >= params.min_new_tokens:
            return []
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        return sorted(banned)

    def check(self, req: Req) -> Optional[FinishReason]:
        """The finish reason of `req` given its outputs so far, or None while it should go on."""
        params = req.sampling_params
        num_outputs = len(req.output_ids)
        if num_outputs >= params.min_new_tokens and num_outputs > 0:
            last = req.output_ids[-1]
            if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
                return FinishReason.stop(last)
            if params.stop:
                matched = self._match_stop_string(req.output_ids, params.stop, params.skip_special_tokens)
                if matched is not None:
                    return FinishReason.stop(matched)
        if num_outputs >= params.max_new_tokens:
            return FinishReason.max_length(num_outputs)
        return None

    def _match_stop_string(self, output_ids: list[int], stops: Sequence[str], skip_special: bool) -> Optional[str]:
        if self.tokenizer is None:
            raise RuntimeError("stop strings need a tokenizer")
        longest = max(len(s) for s in stops)
        tail_len = TOKENS_PER_STOP_CHAR * longest + TAIL_SLACK_TOKENS
        tail = output_ids[-tail_len:]
        text = self.tokenizer.decode(tail, skip_special_tokens=skip_special)
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=skip_special) if len(tail) > 1 else ""
        # A match that lies wholly inside `before` would have stopped the request one token earlier (or was
        # an artefact of cutting the tail mid-character); only matches ending in the new text count.
        new_from = _common_prefix_len(text, before)
        best: Optional[tuple[int, str]] = None
        for stop in stops:
            if not stop:
                continue
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best[1] if best is not None else None


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
