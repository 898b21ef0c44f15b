"""Freeing the window KV of positions that left a running request's sliding window (radix_cache/swa_pool.py).

After a batch, request r has KV for its positions below `end` (the batch's prefix plus extend for r); its next query,
at `end`, reads the window layers' keys at positions above `end - W`, and every later query reads later ones. So the
window slots of positions `[0, end - W + 1)` are dead for r, and they are freed once the batch's results are
processed:

- r's own tokens (not in the tree) are r's alone: their window slots are freed;
- tokens of r's cached prefix belong to the tree: their window slots are freed only on nodes that no one but r holds,
  and never the W - 1 positions before a resume point the tree keeps (`PrefixCache.release_window`,
  radix_cache/swa.py).

Why after the batch's results, not when the next batch is built: with the overlap loop, the batch built next may be
planned before the batch in flight runs, and the one in flight still reads positions the next one no longer needs.
Once a batch's results are processed it has run, and the batches after it read only positions at or above
`end - W + 1`; a freed window slot is written again only by a batch built later, which runs after them.
"""

from __future__ import annotations

from typing import Any

from radixserve.radix_cache.base import PrefixCache
from radixserve.radix_cache.pool import ReqToTokenPool
from radixserve.scheduler.req import Req


class WindowRelease:
    def __init__(self, allocator: Any, cache: PrefixCache, req_to_token_pool: ReqToTokenPool, window: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.req_to_token_pool = req_to_token_pool
        self.window = window  # the largest window of the model's layers
        self.released_slots = 0  # window slots freed so far (statistics)

    def after_batch(self, batch: Any) -> None:
        """Free what left the window of each request of `batch` (a ScheduleBatch that has run) still holding a row."""
        for req, prefix_len, extend_len in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            if not req.finished and req.req_pool_idx is not None:
                self.release(req, prefix_len + extend_len - self.window + 1)

    def release(self, req: Req, end: int) -> None:
        """Free the window KV of `req`'s positions below `end` that it has not freed yet."""
        start = req.window_released
        if end <= start:
            return
        own_start = len(req.prefix_indices)
        if start < own_start:
            self.released_slots += self.cache.release_window(req, start, min(end, own_start))
        if end > own_start:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx, max(start, own_start):end]
            self.released_slots += self.allocator.release_window(row)
        req.window_released = end
