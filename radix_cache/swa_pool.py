"""Two slot spaces for sliding-window models: full slots for every layer, window slots for the windowed layers.

A full slot (what `req_to_token`, the radix tree and `out_cache_loc` hold) names a token's KV in the full-attention
layers; `full_to_window[full_slot]` names its KV in the sliding-window layers, or 0 (the dummy slot) once that KV is
gone. A token's window KV is needed only while some query still sees it under its window, so the window slot space
is smaller (`--swa-full-tokens-ratio` of the full one) and its slots go back to the free list as tokens leave the
windows of the requests that read them (scheduler/window_release.py) or as the radix tree drops them
(radix_cache/swa.py). A full slot's window KV never outlives the full slot: freeing a full slot frees its window
slot too.

Ownership: the window slot of full slot s belongs to whoever owns s (the allocator's free list, a tree node or a
running request); only that owner releases it. Token-granular only (page size 1): a window page would have to stay
until its last token left every window, and the map would have to keep a page's slots together.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from radixserve.radix_cache.pool import KVAllocator, TokenToKVPool


class SWAKVAllocator:
    """Hands out full slots, each with a window slot, through `KVAllocator`'s interface (page size 1).

    `size` and `available_size()` count full slots, so the tree's accounting (`size == free + evictable +
    protected + held`) reads as for one slot space; the window slots have their own figures
    (`window_size`, `window_available_size()`) and check (`check_window_invariants`).
    """

    page_size = 1

    def __init__(self, size: int, window_size: int, device: str | torch.device = "cpu") -> None:
        assert size > 0 and window_size > 0
        self.device = torch.device(device)
        self.full = KVAllocator(size, 1, device)
        self.window = KVAllocator(window_size, 1, device)
        self.size = self.full.size
        self.window_size = self.window.size
        self.full_to_window = torch.zeros(self.size + 1, dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        self.full.clear()
        self.window.clear()
        self.full_to_window.zero_()

    # ---- accounting ------------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.full.available_size()

    def window_available_size(self) -> int:
        return self.window.available_size()

    def free_page_list(self) -> list[int]:
        return self.full.free_page_list()

    def window_shortfall(self, num_tokens: int) -> int:
        """Window slots missing for an allocation of `num_tokens` tokens."""
        return max(0, num_tokens - self.window.available_size())

    # ---- allocation ------------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Full slots for `num_tokens` tokens, each with a fresh window slot; None (taking nothing) when either
        space is short."""
        if num_tokens > self.full.available_size() or num_tokens > self.window.available_size():
            return None
        full = self.full.alloc(num_tokens)
        window = self.window.alloc(num_tokens)
        assert full is not None and window is not None
        self.full_to_window[full] = window
        return full

    def alloc_extend(self, last_slots: Sequence[int], num_new_tokens: Sequence[int]) -> Optional[torch.Tensor]:
        return self.alloc(int(sum(num_new_tokens)))

    # ---- freeing ---------------------------------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """Free full `slots` and the window slots they still have."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.device, torch.int64)
        self.release_window(slots)
        self.full.free(slots)

    def release_window(self, slots: torch.Tensor) -> int:
        """Free the window slots of full `slots` (those that have one); the full slots stay. Returns how many."""
        if slots.numel() == 0:
            return 0
        slots = slots.to(self.device, torch.int64)
        window = self.full_to_window[slots]
        window = window[window != 0]
        if window.numel():
            self.window.free(window)
            self.full_to_window[slots] = 0
        return int(window.numel())

    def has_window(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool per full slot of `slots`: whether its window KV is still there (on the CPU)."""
        return (self.full_to_window[slots.to(self.device, torch.int64)] != 0).cpu()

    def adopt_window(self, tree_slots: torch.Tensor, own_slots: torch.Tensor) -> None:
        """Move the window slots of `own_slots` to `tree_slots` (the same tokens) where the tree's have none: a request
        whose own copies of cached tokens are freed gives their window KV to the cache instead."""
        tree_slots = tree_slots.to(self.device, torch.int64)
        own_slots = own_slots.to(self.device, torch.int64)
        tree_window, own_window = self.full_to_window[tree_slots], self.full_to_window[own_slots]
        move = (tree_window == 0) & (own_window != 0)
        if bool(move.any()):
            self.full_to_window[tree_slots[move]] = own_window[move]
            self.full_to_window[own_slots[move]] = 0

    # ---- invariants ------------------------------------------------------------------------------
    def check_window_invariants(self) -> None:
        """Raise AssertionError unless every window slot is free or held by exactly one full slot in use."""
        mapped = self.full_to_window[1:].cpu()
        live = mapped[mapped != 0]
        free_window = self.window.free_page_list()
        if len(torch.unique(live)) != len(live):
            raise AssertionError("window slot accounting: a window slot is held by two full slots")
        if len(live) + len(free_window) != self.window_size:
            raise AssertionError(f"window slot accounting: {len(live)} held + {len(free_window)} free != "
                                 f"{self.window_size}")
        if set(free_window) & set(live.tolist()):
            raise AssertionError("window slot accounting: a free window slot is held by a full slot")
        free_full = torch.tensor(self.full.free_page_list(), dtype=torch.int64)
        if free_full.numel() and bool((self.full_to_window.cpu()[free_full] != 0).any()):
            raise AssertionError("window slot accounting: a free full slot still holds a window slot")


class SWAKVPool(TokenToKVPool):
    """`TokenToKVPool` whose windowed layers' buffers hold `window_size` slots, read and written through
    `window_map` (the allocator's `full_to_window`): a window layer's K/V for full slot s sits at `window_map[s]`."""

    def __init__(self, size: int, window_size: int, layer_windows: Sequence[Optional[int]], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, window_map: torch.Tensor, device: str | torch.device = "cpu",
                 layer_shapes: Optional[Sequence[tuple[int, int]]] = None) -> None:
        self.window_layers = tuple(w is not None for w in layer_windows)
        self.window_sizes = tuple(sorted({w for w in layer_windows if w is not None}))
        assert self.window_sizes, "a window slot space for a model without windows"
        self.window_size = window_size
        rows = [(window_size if windowed else size) + 1 for windowed in self.window_layers]
        super().__init__(size, 1, len(self.window_layers), num_kv_heads, head_dim, dtype, device, layer_shapes,
                         layer_rows=rows)
        self.window_map = window_map

    def is_window_layer(self, layer_id: int) -> bool:
        return self.window_layers[layer_id]

    def window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        return self.window_map[full_slots.to(torch.int64)]

    @staticmethod
    def bytes_per_token_split(layer_shapes: Sequence[tuple[int, int]], window_layers: Sequence[bool],
                              dtype: torch.dtype) -> tuple[int, int]:
        """(bytes of a token in the full layers, bytes of a token in the window layers)."""
        full = [shape for shape, windowed in zip(layer_shapes, window_layers) if not windowed]
        window = [shape for shape, windowed in zip(layer_shapes, window_layers) if windowed]
        return TokenToKVPool.bytes_per_token_of(full, dtype), TokenToKVPool.bytes_per_token_of(window, dtype)


def split_kv_budget(budget_bytes: int, full_token_bytes: int, window_token_bytes: int, ratio: float) -> tuple[int, int]:
    """(full slots, window slots) that `budget_bytes` holds with `ratio` window slots per full slot."""
    full = int(budget_bytes // (full_token_bytes + ratio * window_token_bytes))
    return full, max(1, int(full * ratio))
