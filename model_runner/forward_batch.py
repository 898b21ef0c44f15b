"""The batch the ModelRunner executes: one forward pass over some requests' new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from radixserve.radix_cache.pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill of new tokens, possibly on top of a cached prefix
    DECODE = 2  # exactly one new token per request
    MIXED = 3  # an extend batch in which some requests are decoding (extend length 1)

    def is_extend(self) -> bool:
        """MIXED runs through the extend path of every attention backend."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class PrefixGroups:
    """Requests of a batch that hold the same KV slots for a cached prefix (the radix tree's nodes they share):
    every member of group g (batch indices, ascending) has the slots of its first `lengths[g]` positions in
    common with the others. A request is in at most one group; groups have two members or more."""

    members: list[list[int]]
    lengths: list[int]  # shared positions per group, whole pages

    def saved_positions(self) -> int:
        """KV positions per layer that attention reads once per group instead of once per member."""
        return sum((len(members) - 1) * length for members, length in zip(self.members, self.lengths))


@dataclass
class StateSlots:
    """Where each request of a hybrid model's batch finds and leaves its recurrent state (radix_cache/state_pool.py).

    Per request i: the state is read from slot `read[i]` (-1: a fresh zero state, the request starts at position 0;
    a snapshot slot when it resumes from a cached prefix; else its own working slot), the state after its new
    tokens is written to `write[i]` (its working slot) and, when `snapshot[i] >= 0`, also to that snapshot slot;
    when `before_last[i] >= 0` (an extend of two tokens or more), the state before its last new token goes there.
    """

    read: list[int]
    write: list[int]
    snapshot: list[int]
    before_last: list[int]

    @classmethod
    def of_rows(cls, rows: list[int], prefix_lens: list[int]) -> "StateSlots":
        """Each request in its row's working slot, fresh where it has no prefix, no snapshots."""
        none = [-1] * len(rows)
        return cls([row if prefix else -1 for row, prefix in zip(rows, prefix_lens)], list(rows), none, none)


@dataclass
class ForwardBatch:
    """Token-major inputs of one forward pass.

    Per request i (in batch order): `prefix_lens[i]` tokens already have KV in the pool (cached prefix or
    earlier chunks), `extend_lens[i]` new tokens are computed now, `seq_lens[i] = prefix_lens[i] +
    extend_lens[i]`. The new tokens of all requests are concatenated in `input_ids`, `positions` and
    `out_cache_loc` (their KV slots, already written into `req_to_token` by the caller). The `*_cpu` lists
    mirror the tensors so backends can plan without a device sync.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [batch_size] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [batch_size] int64
    prefix_lens: torch.Tensor  # [batch_size] int64
    extend_lens: torch.Tensor  # [batch_size] int64
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "TokenToKVPool"
    # Positions (into the concatenated new tokens) whose logits are wanted; default: each request's last.
    logits_indices: Optional[torch.Tensor] = None
    attn_metadata: object = field(default=None, repr=False)  # filled by the attention backend's plan()
    # Each request's LoRA adapter name (None: the base model); None when no request of the batch has one.
    lora_names: Optional[list[Optional[str]]] = None
    # DECODE batches: requests sharing a cached prefix, for backends that read it once per group (cascade
    # attention); None when not computed. Attention results are the same with or without it.
    prefix_groups: Optional[PrefixGroups] = None
    # False for an encoder's batch (set by the runner from its model): every token attends to its whole sequence.
    causal: bool = True
    # Hybrid models: each request's recurrent-state slots; None: `StateSlots.of_rows` (no prefix cache involved).
    state_slots: Optional[StateSlots] = None
    # A pool whose window layers have slots of their own (radix_cache/swa_pool.py): the window slots where those layers
    # write the new tokens' K/V, set by the runner before planning (`window_write_slots`); None otherwise.
    window_cache_loc: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def kv_write_loc(self, layer_id: int) -> torch.Tensor:
        """Where layer `layer_id` writes the new tokens' K/V: `window_cache_loc` for a window layer of a pool with a
        window slot space, `out_cache_loc` otherwise."""
        if self.window_cache_loc is not None and self.token_to_kv_pool.is_window_layer(layer_id):
            return self.window_cache_loc
        return self.out_cache_loc

    def window_write_slots(self) -> torch.Tensor:
        """The window slots of the new tokens' positions, read through `req_to_token`: the row, not `out_cache_loc`,
        names the slot a later query reads (a token the tree already held is read at the tree's slot, which took the
        window slot of the request's copy: radix_cache/swa.py)."""
        extend_lens = self.extend_lens
        rows = torch.repeat_interleave(self.req_pool_indices, extend_lens)
        first = torch.repeat_interleave(self.prefix_lens - (torch.cumsum(extend_lens, 0) - extend_lens), extend_lens)
        positions = first + torch.arange(rows.numel(), device=rows.device)
        full = self.req_to_token_pool.req_to_token[rows, positions]
        return self.token_to_kv_pool.window_map[full.to(torch.int64)]

    def last_token_indices(self) -> torch.Tensor:
        """Index of each request's last new token in the concatenated token dimension."""
        return torch.cumsum(self.extend_lens, dim=0) - 1
