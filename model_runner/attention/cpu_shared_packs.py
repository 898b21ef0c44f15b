"""Packed copies of shared prefixes' keys and values for the CPU attention kernel, kept across decode steps.

A group of requests on one cached prefix reads that prefix's keys on AMX tiles (bfloat16): per tile of 32 keys
and KV head, the keys as contiguous rows and the values transposed. Gathered from the pool through the prefix's
slots and transposed at every call, that was the largest single cost of a decode attention call, and a prefix's
keys are the same at every step while its requests decode. So each prefix (its exact slot list) gets a packed
copy per layer (`torch.ops.radixserve_cpu.pack_shared_kv`, layout in `kernels/cpu_attention_pack.h`), made at the
layer's first call that needs it and passed to the kernel at every later one.

Why a copy is never stale. A slot's K/V change only when it is written: by a forward batch (at its
`out_cache_loc`, slots allocated for that batch) or by the host tier's load-back (slots allocated for a request
being admitted); neither writes a slot that a running request holds. A copy is made from a group's shared
prefix, whose slots its requests hold, and it is handed out again only in the next batch, only if that batch is a
DECODE batch and uses the same slot list: a DECODE batch admits no request (admission leads to an extend batch),
so nothing was allocated and written between the two batches but that batch's own new slots. Every other batch
(extend, mixed) starts from no copies, a batch drops the copies it does not use, and another pool drops them all.

Memory: a prefix's copies take what its K/V take in the pool (rounded up to 32 keys), every layer's bytes
reserved when the prefix is first seen, within `budget_bytes`; prefixes beyond it gather as before.
`RADIXSERVE_CPU_KV_PACK_MIB` sets the budget (default 256 MiB; 0: no copies).
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode

DEFAULT_BUDGET_MIB = 256
PACK_TILE = 32  # keys per packed tile (kPackTile)
LANE_MIN_ROWS = 8  # query rows per KV head from which the kernel's group path uses tile products (kLaneMinRows)


def budget_from_env() -> int:
    """The byte budget: `RADIXSERVE_CPU_KV_PACK_MIB` MiB (default 256; 0 turns the copies off)."""
    return int(float(os.environ.get("RADIXSERVE_CPU_KV_PACK_MIB", DEFAULT_BUDGET_MIB)) * (1 << 20))


@dataclass
class SharedPack:
    """One prefix's packed keys and values, per layer (None until its layer's first call; the empty tensor
    where the kernel has no packed form for this pool)."""

    slots: torch.Tensor  # int64, the prefix's KV slots in position order
    nbytes: int  # reserved for all layers
    layers: list[Optional[torch.Tensor]] = field(default_factory=list)


class SharedKvPacks:
    """The packed copies of one attention backend, by prefix slot list (see the module docstring)."""

    def __init__(self, budget_bytes: Optional[int] = None) -> None:
        self.budget_bytes = budget_from_env() if budget_bytes is None else budget_bytes
        self._packs: dict[bytes, SharedPack] = {}
        self._pool: Optional[weakref.ref] = None
        self.reserved_bytes = 0
        self.supported = True  # False once the kernel had no packed form for this backend's pool
        self.num_built = 0  # (prefix, layer) copies made
        self.num_reused = 0  # (group, layer) calls given a copy made before

    def clear(self) -> None:
        self._packs.clear()
        self.reserved_bytes = 0

    def begin(self, batch: ForwardBatch) -> None:
        """At every batch's plan, before `assign`: only a DECODE batch on the same pool keeps copies."""
        pool = batch.token_to_kv_pool
        if self._pool is None or self._pool() is not pool:
            self.supported = True
        if batch.mode != ForwardMode.DECODE or self._pool is None or self._pool() is not pool:
            self.clear()
            self._pool = weakref.ref(pool)

    def assign(self, batch: ForwardBatch, prefixes: list[Optional[torch.Tensor]]) -> list[Optional[SharedPack]]:
        """The copies for `batch`'s groups, whose shared prefixes are `prefixes` (slot lists; None: the group
        has no use for a copy), None where a group has none; equal lists share one copy. Drops every copy the
        batch does not use. Outside DECODE batches a copy is made only for a prefix that several groups read
        (a copy read once costs more than the gather it replaces, and no later batch reuses it)."""
        if self.budget_bytes <= 0 or not self.supported:
            self.clear()
            return [None] * len(prefixes)
        keys = [None if slots is None else slots.numpy().tobytes() for slots in prefixes]
        self._packs = {key: self._packs[key] for key in set(keys) if key in self._packs}
        self.reserved_bytes = sum(pack.nbytes for pack in self._packs.values())
        pool = batch.token_to_kv_pool
        buffer = pool.k_buffer[0]
        per_token = 2 * buffer.shape[1] * buffer.shape[2] * buffer.element_size() * len(pool.k_buffer)
        readers = Counter(keys)
        result = []
        for key, slots in zip(keys, prefixes):
            pack = None if key is None else self._packs.get(key)
            if key is not None and pack is None and (batch.mode == ForwardMode.DECODE or readers[key] > 1):
                nbytes = -(-slots.numel() // PACK_TILE) * PACK_TILE * per_token
                if self.reserved_bytes + nbytes <= self.budget_bytes:
                    pack = SharedPack(slots.to(torch.int64).contiguous(), nbytes, [None] * len(pool.k_buffer))
                    self._packs[key] = pack
                    self.reserved_bytes += nbytes
            result.append(pack)
        return result

    def for_layer(self, packs: list[Optional[SharedPack]], layer_id: int, k_buffer: torch.Tensor,
                  v_buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per group, its prefix's copy for this layer (made now if this is the layer's first call since the
        prefix was seen), or an empty tensor; an empty list where no group has one."""
        if not any(pack is not None for pack in packs):
            return []
        tensors = []
        for pack in packs:
            if pack is None:
                tensors.append(_EMPTY)
                continue
            packed = pack.layers[layer_id]
            if packed is None:
                packed = torch.ops.radixserve_cpu.pack_shared_kv(k_buffer, v_buffer, pack.slots)
                if packed.numel() == 0:  # no packed form here (see pack_shared_kv): gather as before
                    self.supported = False
                    self.clear()
                    return []
                pack.layers[layer_id] = packed
                self.num_built += 1
            else:
                self.num_reused += 1
            tensors.append(packed)
        return tensors

    @property
    def num_packs(self) -> int:
        return len(self._packs)

    def prefixes(self) -> list[torch.Tensor]:
        """The slot lists that have copies now."""
        return [pack.slots for pack in self._packs.values()]


_EMPTY = torch.empty(0, dtype=torch.bfloat16)
