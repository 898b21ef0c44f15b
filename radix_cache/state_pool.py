"""Recurrent-state memory of hybrid models: the state pool beside the KV pool.

A Gated DeltaNet layer keeps, per sequence, a convolution state `[conv_dim, conv_kernel - 1]` and a recurrent state
`[value_heads, key_head_dim, value_head_dim]` in place of KV. The pool holds both for every linear layer, in slots:

- working slots `0 .. num_rows - 1`, one per request row of the `ReqToTokenPool`: a running request's state lives in
  the slot of its row, so it is taken and given back with the row and never allocated on its own;
- snapshot slots `num_rows .. size - 1`: copies of a state at a prefix boundary, owned by the radix tree's nodes
  (radix_cache/hybrid.py), handed out and freed here.

Ownership: a snapshot slot belongs to the free list or to exactly one tree node; `check_invariants` proves it from
the owners the tree reports. Snapshots are written by the model in the forward pass that computes them (a batch
names the slot), and copied into a working slot by the forward pass that resumes from them, so every read follows
its write in stream order however far the scheduler runs ahead.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StatePool:
    """Conv and recurrent states of `num_layers` linear layers in `size` slots (see the module docstring)."""

    def __init__(self, num_rows: int, size: int, num_layers: int, conv_dim: int, conv_width: int, num_heads: int,
                 key_dim: int, value_dim: int, ssm_dtype: torch.dtype, conv_dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        if size <= num_rows:
            raise ValueError(f"a state pool of {size} slots leaves no snapshot slot beside the {num_rows} request "
                             "rows; raise --max-mamba-cache-size")
        self.num_rows = num_rows
        self.size = size
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.conv = [torch.zeros(size, conv_dim, conv_width - 1, dtype=conv_dtype, device=self.device)
                     for _ in range(num_layers)]
        self.recurrent = [torch.zeros(size, num_heads, key_dim, value_dim, dtype=ssm_dtype, device=self.device)
                          for _ in range(num_layers)]
        self.clear()

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_width: int, num_heads: int, key_dim: int, value_dim: int,
                       ssm_dtype: torch.dtype, conv_dtype: torch.dtype) -> int:
        def size_of(dtype: torch.dtype) -> int:
            return torch.empty((), dtype=dtype).element_size()

        return num_layers * (conv_dim * (conv_width - 1) * size_of(conv_dtype)
                             + num_heads * key_dim * value_dim * size_of(ssm_dtype))

    @property
    def num_snapshot_slots(self) -> int:
        return self.size - self.num_rows

    def clear(self) -> None:
        self._free: list[int] = list(range(self.size - 1, self.num_rows - 1, -1))

    # ---- snapshot slots ------------------------------------------------------------------------------
    def available_snapshots(self) -> int:
        return len(self._free)

    def alloc_snapshot(self) -> Optional[int]:
        """A free snapshot slot, or None when every one is held."""
        return self._free.pop() if self._free else None

    def free_snapshot(self, slot: int) -> None:
        assert self.num_rows <= slot < self.size, f"slot {slot} is not a snapshot slot"
        self._free.append(slot)

    # ---- state movement (the model calls these inside its forward pass) ---------------------------------
    def read(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) states at `slots` `[B]`, as new tensors, zeroed where `fresh` `[B]` (a sequence
        starting at position 0)."""
        conv = self.conv[layer][slots]
        recurrent = self.recurrent[layer][slots]
        if bool(fresh.any()):
            conv[fresh] = 0
            recurrent[fresh] = 0
        return conv, recurrent

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store states `[B, ...]` at `slots` `[B]` (distinct)."""
        self.conv[layer][slots] = conv.to(self.conv[layer].dtype)
        self.recurrent[layer][slots] = recurrent.to(self.recurrent[layer].dtype)

    def copy(self, source: int, destination: int) -> None:
        """Copy every layer's states from slot `source` to slot `destination` (a finished request's working slot
        into a snapshot). Issued after the last batch that wrote `source`, before any batch that reads
        `destination`."""
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[destination].copy_(conv[source])
            recurrent[destination].copy_(recurrent[source])

    # ---- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, held: Iterable[int]) -> None:
        """Raise AssertionError unless every snapshot slot is free or held by exactly one owner in `held`."""
        held = list(held)
        free = self._free
        assert len(set(free)) == len(free), "a snapshot slot is free twice"
        assert len(set(held)) == len(held), "a snapshot slot is held twice"
        assert not set(free) & set(held), "a snapshot slot is both free and held"
        assert all(self.num_rows <= s < self.size for s in free + held), "a working slot is among the snapshots"
        assert len(free) + len(held) == self.num_snapshot_slots, (
            f"snapshot accounting: {self.num_snapshot_slots} slots != free {len(free)} + held {len(held)}")


class HostStatePool:
    """Host copies of snapshots for the hierarchical cache (radix_cache/hybrid_hiradix.py): `size` slots, each every
    linear layer's conv and recurrent state of one snapshot, in the device pool's dtypes (pinned on CUDA).

    Ownership as on the device: a host slot is free or held by exactly one tree node. Copies run on the current
    stream, in order with the batches and with `StatePool.copy`: a backup reads a snapshot whose writing batches
    were issued before it, a load is issued before the batch that reads the loaded snapshot."""

    def __init__(self, device_pool: StatePool, size: int) -> None:
        if size < 1:
            raise ValueError(f"a host state pool needs at least one slot, got {size}")
        self.device_pool = device_pool
        self.size = size
        pinned = device_pool.device.type == "cuda"
        self.conv = [torch.empty((size,) + tuple(t.shape[1:]), dtype=t.dtype, pin_memory=pinned)
                     for t in device_pool.conv]
        self.recurrent = [torch.empty((size,) + tuple(t.shape[1:]), dtype=t.dtype, pin_memory=pinned)
                          for t in device_pool.recurrent]
        self.clear()

    def clear(self) -> None:
        self._free: list[int] = list(range(self.size - 1, -1, -1))

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.conv + self.recurrent)

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        """A free host slot, or None when every one is held."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.size, f"slot {slot} is not a host state slot"
        self._free.append(slot)

    def backup(self, device_slot: int, host_slot: int) -> None:
        """Copy every layer's states of device snapshot slot `device_slot` into host slot `host_slot`."""
        for host, device in zip(self.conv + self.recurrent, self.device_pool.conv + self.device_pool.recurrent):
            host[host_slot].copy_(device[device_slot])

    def load(self, host_slot: int, device_slot: int) -> None:
        """Copy host slot `host_slot` into device snapshot slot `device_slot`."""
        for host, device in zip(self.conv + self.recurrent, self.device_pool.conv + self.device_pool.recurrent):
            device[device_slot].copy_(host[host_slot])

    def check_invariants(self, held: Iterable[int]) -> None:
        """Raise AssertionError unless every host slot is free or held by exactly one owner in `held`."""
        held = list(held)
        assert len(set(held)) == len(held), "a host state slot is held twice"
        assert len(set(self._free)) == len(self._free), "a host state slot is free twice"
        assert not set(self._free) & set(held), "a host state slot is both free and held"
        assert len(self._free) + len(held) == self.size, (
            f"host state accounting: {self.size} slots != free {len(self._free)} + held {len(held)}")
