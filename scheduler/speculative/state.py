"""Per-request speculative state: the n-gram index, the adaptive draft length, and the acceptance counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from radixserve.scheduler.speculative.ngram import TokenIndex

# Weight of the latest verify step in the acceptance-rate average that sets the draft length.
ACCEPTANCE_EMA_WEIGHT = 0.5
# Prompt lookup (NGRAM): a match of the sequence's last STRONG_MATCH_LEN tokens or more proposes a full chain
# whatever the request's acceptance rate; a match of the last token alone proposes `draft_len`. Measured over the
# benchmark's greedy outputs (docs/benchmarks.md): the first draft after a 1-token match was accepted 5-42% of the
# time, after 2 tokens 33-61%, after 3 or more 67-100%, with runs of 2 to 10 accepted drafts; on the CPU a verify
# chain of 6 costs 1.39x a decode step and one of 8 1.50x, so a long match pays for a full chain even in a
# request whose last chains were rejected.
STRONG_MATCH_LEN = 2


@dataclass
class SpecState:
    """Kept on `Req.spec` while speculative decoding runs.

    Draft length: a STANDALONE draft model proposes `draft_len`, `max_drafts` scaled by an exponential average of
    the request's acceptance rate (at least one draft), so a request whose text does not repeat itself soon
    verifies one cheap draft per step instead of `max_drafts`, and one that copies its input goes back to long
    chains as soon as they are accepted. Prompt lookup proposes a full chain after a match of several tokens, the
    strongest evidence a draft has, and `draft_len` drafts after a 1-token match (`ngram_draft_len`).
    """

    max_drafts: int
    index: TokenIndex = field(default_factory=TokenIndex)
    acceptance_ema: float = 1.0
    verify_ct: int = 0  # verify steps the request took part in (SGLang's spec_verify_ct)
    num_proposed: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    # STANDALONE: the request's row in the draft model's req_to_token pool, and how many of its leading tokens
    # have draft KV (scheduler/speculative/draft_model.py).
    draft_row: Optional[int] = None
    draft_kv_len: int = 0
    # The draft tree's prefix the row starts with (its slots belong to the tree) and the locked node ending it.
    draft_prefix_len: int = 0
    draft_node: Any = None

    @property
    def draft_len(self) -> int:
        return max(1, min(self.max_drafts, round(self.acceptance_ema * self.max_drafts)))

    def ngram_draft_len(self, match_len: int) -> int:
        """Drafts to copy after a prompt-lookup match of `match_len` tokens (0: no match): a full chain after a
        strong match, the acceptance-scaled `draft_len` after a 1-token match."""
        if match_len >= STRONG_MATCH_LEN:
            return self.max_drafts
        return self.draft_len if match_len >= 1 else 0

    def on_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.verify_ct += 1
        if num_proposed == 0:
            return
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        rate = num_accepted / num_proposed
        self.acceptance_ema = (1 - ACCEPTANCE_EMA_WEIGHT) * self.acceptance_ema + ACCEPTANCE_EMA_WEIGHT * rate
