"""A request's KV handed to the radix tree: `cache_finished_req` and `cache_unfinished_req`, the request-level
operations of `RadixCache` (tree.py), and who frees which of the request's slots.

A request's row in `req_to_token` holds the tree's slots of its cached prefix (`req.prefix_indices`, locked through
`req.last_node`), then slots of its own. The tree takes the request's slots of the page-aligned tokens it did not
have; the request's copies of tokens the tree already had are freed here, and its unaligned tail page is freed when
it finishes, kept by it while it runs.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.radix_cache.base import PrefixCache


class RequestCaching(PrefixCache):
    """The request-level operations of the radix cache, the base of `RadixCache`: written over the tree's own
    operations, which `RadixCache` defines (`_namespace_root`, `_insert`, `_match`, `inc_lock_ref`, `dec_lock_ref`).
    A cache that keeps more per slot changes what happens to a chunk's duplicate slots through `_adopt_duplicates`
    and `_free_duplicates`."""

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """Hand a finished (or aborted, or retracted) request's KV to the tree and release its lock.

        `token_ids` are the tokens whose KV is in `req_to_token[req.req_pool_idx, :len(token_ids)]`, the first
        `len(req.prefix_indices)` of them the tree's slots (locked through `req.last_node`), the rest the request's
        own. The page-aligned part is inserted; the request's own slots for tokens the tree already had, and its
        unaligned tail page, are freed here. The request row itself is not freed. Call once per request.
        """
        own_start, num_aligned, row = self._request_slots(req, token_ids)
        present = own_start
        if num_aligned > 0:
            present = self._insert(self._namespace_root(req.namespace, create=True), token_ids, num_aligned, row)
            self._check_prefix_held(req, present, own_start)
        self.allocator.free(torch.cat([row[own_start:present], row[num_aligned:]]))
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """Cache the KV a still-running request has computed so far (chunked prefill), keeping it locked.

        Same inputs as `cache_finished_req`. Inserts the page-aligned part, frees the request's copies of tokens
        the tree already had and writes the tree's slots into the request's row in their place, moves the lock to
        the new last node, and sets `req.prefix_indices` (the tree's slots, length = the aligned part) and
        `req.last_node`. The unaligned tail, `req_to_token[row, len(req.prefix_indices):len(token_ids)]`, stays
        owned by the request.
        """
        own_start, num_aligned, row = self._request_slots(req, token_ids)
        if num_aligned == own_start:
            return  # no whole page beyond what the request already holds through the tree
        ns_root = self._namespace_root(req.namespace, create=True)
        present = self._insert(ns_root, token_ids, num_aligned, row)
        self._check_prefix_held(req, present, own_start)
        match = self._match(ns_root, token_ids, num_aligned, touch=False)
        assert match.length == num_aligned, "an insert must be matchable right after it"
        self._adopt_duplicates(row[own_start:present], match.indices[own_start:present])
        self._free_duplicates(row[own_start:present])
        req_row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        req_row[own_start:present] = match.indices[own_start:present].to(req_row.dtype)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def _adopt_duplicates(self, own_slots: torch.Tensor, tree_slots: torch.Tensor) -> None:
        """Before a chunk's own copies of cached tokens are freed: what of them the tree's slots lack, the tree takes
        (the window KV of a sliding-window model, radix_cache/swa.py); nothing here."""

    def _free_duplicates(self, slots: torch.Tensor) -> None:
        """Free a chunk's own slots for tokens the tree already had. The batch being built still writes them, which
        is harmless: any later user of a freed slot is a later batch (the hierarchical cache defers these)."""
        self.allocator.free(slots)

    def _request_slots(self, req: Any, token_ids: list[int]) -> tuple[int, int, torch.Tensor]:
        num_tokens = len(token_ids)
        own_start = len(req.prefix_indices)
        if own_start > num_tokens or own_start % self.page_size:
            raise ValueError(f"prefix of {own_start} tokens does not fit {num_tokens} tokens in whole pages")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :num_tokens].to(torch.int64, copy=True)
        return own_start, num_tokens - num_tokens % self.page_size, row

    @staticmethod
    def _check_prefix_held(req: Any, present: int, own_start: int) -> None:
        # The request's prefix is locked, hence still in the tree: anything else means its prefix_indices,
        # last_node or namespace do not describe the same tokens, and freeing would corrupt ownership.
        if present < own_start:
            raise AssertionError(f"request prefix of {own_start} tokens is not in the tree (found {present})")
