"""The runner's LoRA adapters: which are loaded, which pool slot each one holds, and the per-batch slot map.

Loaded adapters stay on the host (`LoRAAdapter`); a batch's adapters are copied into the device pool's
`max_loras_per_batch` slots when the batch needs them (`prepare`), taking first the free slots, then the slot
used longest ago by an adapter not in this batch. The scheduler guarantees a batch names at most
`max_loras_per_batch` distinct adapters and never one that is unloaded while a request of it is alive.

Thread-safety: `load`/`unload` run on the scheduler's thread, `prepare` on the executor's (under overlap);
the slot table is shared under one lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Optional

import torch
from torch import nn

from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.lora.adapter import LoRAAdapter, LoRAAdapterError, read_adapter
from radixserve.model_runner.lora.layers import LoRABatch, LoRAContext, LoRALinear, LoRAWeightPool

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config, max_loras_per_batch: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers = config.num_hidden_layers
        self.max_loras_per_batch = max_loras_per_batch
        self.max_rank = max_rank
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.shapes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                       "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate),
                       "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
        self.pool = LoRAWeightPool(self.num_layers, self.shapes, max_loras_per_batch, max_rank, dtype, device)
        self.context = LoRAContext()
        self.device = device
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slot_owner: list[Optional[str]] = [None] * max_loras_per_batch
        self._slot_used: list[int] = [0] * max_loras_per_batch
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self._wrap(model, q_size, kv_size, intermediate)

    def _wrap(self, model: nn.Module, q_size: int, kv_size: int, intermediate: int) -> None:
        fused = {
            "qkv_proj": [("q_proj", 0, q_size), ("k_proj", q_size, q_size + kv_size),
                         ("v_proj", q_size + kv_size, q_size + 2 * kv_size)],
            "o_proj": [("o_proj", 0, None)],
            "gate_up_proj": [("gate_proj", 0, intermediate), ("up_proj", intermediate, 2 * intermediate)],
            "down_proj": [("down_proj", 0, None)],
        }
        for layer_id, layer in enumerate(model.model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name, parts in fused.items():
                    base = getattr(parent, name, None)
                    if base is None:
                        continue
                    parts = [(m, s, e if e is not None else self.shapes[m][1]) for m, s, e in parts]
                    setattr(parent, name, LoRALinear(base, layer_id, parts, self.pool, self.context))

    # ---- adapters ---------------------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read the adapter at `path` under `name`; LoRAAdapterError when it cannot be served."""
        if not name:
            raise LoRAAdapterError("a LoRA adapter needs a non-empty name")
        if name in self.adapters:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = read_adapter(name, path, self.num_layers, self.shapes, self.max_rank)
        with self._lock:
            self.adapters[name] = adapter
        logger.info("loaded LoRA adapter %s (rank %d, %s) from %s", name, adapter.rank,
                    ", ".join(adapter.target_modules), path)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded")
        with self._lock:
            del self.adapters[name]
            for slot, owner in enumerate(self._slot_owner):
                if owner == name:
                    self._slot_owner[slot] = None
        logger.info("unloaded LoRA adapter %s", name)

    def loaded(self) -> dict[str, str]:
        """Adapter name -> path, in load order."""
        return {name: adapter.path for name, adapter in self.adapters.items()}

    # ---- batches ----------------------------------------------------------------------------------
    def prepare(self, batch: ForwardBatch) -> None:
        """Set the slot map for `batch` (its requests' `lora_names`), loading adapters into slots as needed."""
        names = batch.lora_names
        if not names or not any(names):
            self.context.batch = None
            return
        wanted = list(dict.fromkeys(n for n in names if n))
        if len(wanted) > self.max_loras_per_batch:
            raise RuntimeError(f"a batch names {len(wanted)} LoRA adapters, above max_loras_per_batch "
                               f"{self.max_loras_per_batch}")
        with self._lock:
            slot_of = self._assign_slots(wanted)
        request_slots = [slot_of[n] if n else -1 for n in names]
        self.context.batch = _groups(request_slots, batch.extend_lens_cpu, self.device)

    def _assign_slots(self, wanted: list[str]) -> dict[str, int]:
        resident = {owner: slot for slot, owner in enumerate(self._slot_owner) if owner is not None}
        slot_of: dict[str, int] = {}
        for name in wanted:
            if name in resident:
                slot_of[name] = resident[name]
        taken = set(slot_of.values())
        for name in wanted:
            if name in slot_of:
                continue
            if name not in self.adapters:
                raise RuntimeError(f"LoRA adapter {name!r} is not loaded")
            free = [s for s in range(len(self._slot_owner)) if s not in taken]
            slot = min(free, key=lambda s: (self._slot_owner[s] is not None, self._slot_used[s]))
            self.pool.write(slot, self.adapters[name].weights)
            self._slot_owner[slot] = name
            slot_of[name] = slot
            taken.add(slot)
        now = next(self._clock)
        for slot in taken:
            self._slot_used[slot] = now
        return slot_of


def _groups(request_slots: list[int], extend_lens: list[int], device: torch.device) -> LoRABatch:
    """Token indices per slot, from each request's slot (-1: the base model) and its number of new tokens."""
    num_tokens = sum(extend_lens)
    per_token = torch.repeat_interleave(torch.tensor(request_slots, dtype=torch.int64),
                                        torch.tensor(extend_lens, dtype=torch.int64))
    token_slots = per_token.to(device, non_blocking=True) if device.type == "cuda" else None
    if len(set(request_slots)) == 1:
        slot = request_slots[0]
        return LoRABatch([] if slot < 0 else [(slot, None)], num_tokens, token_slots)
    groups = []
    for slot in sorted(set(request_slots)):
        if slot >= 0:
            groups.append((slot, torch.nonzero(per_token == slot).flatten().to(device)))
    return LoRABatch(groups, num_tokens, token_slots)
