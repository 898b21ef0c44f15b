"""KV memory: the request-to-token table, the per-layer KV buffers and the page allocator.

Ownership: every KV page belongs to exactly one owner at a time: the allocator's free list, a node of the
radix tree, or a running request (slots it computed that the tree does not hold yet). The owner frees it,
once. With `page_size > 1` a page is never shared between two owners: a request that matched a cached prefix
(always whole pages) starts its own tokens on a fresh page, and the partially filled tail page of a finished
request is freed by that request rather than handed to the tree.

Slot indices are token-granular (`slot = page * page_size + offset`). Page 0 is reserved as a dummy so that
padded positions can write somewhere harmless; it is never handed out and not counted in `size`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# KV stored as float8 (SGLang's fp8_e4m3 / fp8_e5m2 with a scale of 1: the values are cast as they are) and read
# back in the activations' dtype by every attention backend.
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


class ReqToTokenPool:
    """`req_to_token[row, position] = KV slot index`; one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> Optional[int]:
        """One row for a new request, or None when all rows are taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.size and row not in self._free_rows, f"double free of request row {row}"
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class KVAllocator:
    """Hands out KV slots in whole pages.

    `size` is the number of usable token slots (a multiple of `page_size`). `alloc_extend` places each
    request's new tokens after its last slot, filling the request's own partial tail page before taking new
    pages, so a request's slots are contiguous within each page.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        assert size > 0 and page_size >= 1
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        # Page 0 is the dummy page; usable pages are 1..num_pages. Freed pages wait in `_pending_free` and are
        # merged into `_free_pages` only when an allocation needs them, so a free never copies the free list.
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._pending_free: list[torch.Tensor] = []
        self._num_pending = 0

    # ---- accounting ------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free token slots (whole free pages times page_size)."""
        return (len(self._free_pages) + self._num_pending) * self.page_size

    def free_page_list(self) -> list[int]:
        """Every free page index, pending frees included (for invariant checks and tests)."""
        return torch.cat([self._free_pages, *self._pending_free]).tolist()

    # One slot space: the window figures of radix_cache/swa_pool.py's allocator have nothing to count here.
    def window_shortfall(self, num_tokens: int) -> int:
        return 0

    def release_window(self, slots: torch.Tensor) -> int:
        return 0

    def check_window_invariants(self) -> None:
        pass

    # ---- allocation ------------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Slots for `num_tokens` tokens on fresh pages (page-aligned start), or None if memory is short."""
        num_pages = -(-num_tokens // self.page_size)
        pages = self._take_pages(num_pages)
        if pages is None:
            return None
        return self._pages_to_slots(pages)[:num_tokens].to(self.device)

    def alloc_extend(self, last_slots: Sequence[int], num_new_tokens: Sequence[int]) -> Optional[torch.Tensor]:
        """Slots for the new tokens of several requests, concatenated in request order.

        `last_slots[i]` is the slot of request i's last token already in KV, or -1 when it has none of its
        own pages yet (a fresh request, or one whose matched prefix ended on a page boundary owned by the
        tree). Returns None, allocating nothing, when memory is short.
        """
        p = self.page_size
        if p == 1:
            return self.alloc(int(sum(num_new_tokens)))
        plans = []
        pages_needed = 0
        for last, n in zip(last_slots, num_new_tokens):
            room = 0 if last < 0 else (p - 1 - last % p)
            in_tail = min(room, n)
            fresh = n - in_tail
            plans.append((last, in_tail, fresh))
            pages_needed += -(-fresh // p)
        pages = self._take_pages(pages_needed)
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for last, in_tail, fresh in plans:
            if in_tail:
                out.append(torch.arange(last + 1, last + 1 + in_tail, dtype=torch.int64))
            if fresh:
                k = -(-fresh // p)
                out.append(self._pages_to_slots(pages[cursor:cursor + k])[:fresh])
                cursor += k
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(out).to(self.device)

    # ---- freeing ---------------------------------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding `slots`. The caller must be the single owner of every page it names."""
        if slots.numel() == 0:
            return
        pages = slots.detach().to("cpu", torch.int64)
        if self.page_size > 1:
            pages = torch.unique(pages // self.page_size)
        self._pending_free.append(pages)
        self._num_pending += len(pages)

    # ---- helpers ---------------------------------------------------------------------------------
    def _flush_pending(self) -> None:
        if self._pending_free:
            self._free_pages = torch.cat([self._free_pages, *self._pending_free])
            self._pending_free = []
            self._num_pending = 0

    def _take_pages(self, num_pages: int) -> Optional[torch.Tensor]:
        if num_pages > len(self._free_pages):
            self._flush_pending()
        if num_pages > len(self._free_pages):
            return None
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)


class TokenToKVPool:
    """Per-layer K and V buffers of shape `[size + page_size, num_kv_heads, head_dim]`.

    Index `slot` as handed out by `KVAllocator`; the first page is the dummy page. `layer_shapes` gives each layer its
    own (KV heads, head_dim) where they differ (Gemma 4's full layers); `num_kv_heads` and `head_dim` are then the
    first layer's, and `uniform` is False. `layer_rows` gives each layer's buffer its own number of rows (the window
    layers of radix_cache/swa_pool.py); `window_map` is None here: every layer reads a token's KV at its slot.
    """

    window_map: Optional[torch.Tensor] = None

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layer_shapes: Optional[Sequence[tuple[int, int]]] = None,
        layer_rows: Optional[Sequence[int]] = None,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.layer_shapes = list(layer_shapes) if layer_shapes else [(num_kv_heads, head_dim)] * num_layers
        assert len(self.layer_shapes) == num_layers, "one (KV heads, head_dim) per layer"
        self.num_kv_heads, self.head_dim = self.layer_shapes[0]
        self.uniform = len(set(self.layer_shapes)) == 1
        self.dtype = dtype
        self.device = torch.device(device)
        rows = list(layer_rows) if layer_rows else [size + page_size] * num_layers
        self.k_buffer = [torch.zeros((n, *shape), dtype=dtype, device=self.device)
                         for n, shape in zip(rows, self.layer_shapes)]
        self.v_buffer = [torch.zeros((n, *shape), dtype=dtype, device=self.device)
                         for n, shape in zip(rows, self.layer_shapes)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def bytes_per_token_of(layer_shapes: Sequence[tuple[int, int]], dtype: torch.dtype) -> int:
        """K and V bytes of one token over layers of the given (KV heads, head_dim)."""
        return sum(TokenToKVPool.bytes_per_token(1, heads, dim, dtype) for heads, dim in layer_shapes)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def is_window_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` keeps its KV in a window slot space of its own (radix_cache/swa_pool.py)."""
        return False

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of shape `[num_tokens, num_kv_heads, head_dim]` at slots `loc`."""
        k_buffer, v_buffer = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if k_buffer.is_cuda and k.stride(-1) == 1 and v.stride(-1) == 1:
            # One Triton launch writes both (two indexed scatters otherwise); imported here so that
            # CPU-only processes never import triton.
            from radixserve.kernels.kv_store import store_kv

            store_kv(k_buffer, v_buffer, loc, k, v)
            return
        k_buffer[loc] = k.to(self.dtype)
        v_buffer[loc] = v.to(self.dtype)
