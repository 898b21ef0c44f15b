"""The host tier of the hierarchical cache: KV demoted from the device pool, kept in host RAM, and the copies
between the two.

Layout. One token-major buffer `[size + page_size, num_layers, 2 (K, V), num_kv_heads, head_dim]`, so one
token's KV in every layer is one contiguous run and a node's KV moves as one `[n, layers, 2, heads, dim]` block.
Host slots are handed out by a `KVAllocator` on the CPU in pages of the device pool's page size (page 0 is a
dummy, as on the device), so the same ownership rules hold: every host page belongs to the free list or to one
tree node, which frees it.

Copies. On the CPU (the device pool in RAM, as in CI) every copy is a plain indexed copy, complete when the call
returns. On CUDA the buffer is pinned and copies run on a dedicated copy stream, so they overlap the batch the
device is running. Where the pinned buffer is mapped into the device's address space (unified addressing, every
64-bit CUDA system), the copy stream's gather/scatter kernels read and write it directly over the bus (`_uva`, a
CUDA view of the host buffer): no staging and no host-side copy, and stream order alone keeps a load behind the
backups of the slots it reads. Otherwise (the view cannot be made) the staged path below is used:
- device -> host (`backup`): gathered on the device and copied into pinned staging on the copy stream; the
  staging is scattered into the buffer once its event fired: opportunistically at the next backup, and before
  anything reads slots it writes (a load waits only for the writes of the slots it loads, so it never waits for
  the batch in flight when its own slots were written long ago). The scheduler frees the device slots right
  away: the next batch that may write them is launched after `_fence`, which makes the launching stream wait
  for the copy stream.
- host -> device (`load`, `load_data`): gathered on the host into pinned staging, copied and scattered into the
  device pool on the copy stream, then fenced the same way, so the batch that reads the loaded KV waits for it
  while the batch before it (already launched) runs concurrently.
What a copy reads from the device was written by batches whose results were already processed: the tree only
demotes unlocked nodes, and a request unlocks its nodes after its last batch was processed.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.radix_cache.pool import FLOAT8_DTYPES, KVAllocator, TokenToKVPool

_MAX_PENDING_WRITES = 64


class HostKVPool:
    """`size` host token slots mirroring the layout of `device_pool` (see the module docstring)."""

    def __init__(self, device_pool: TokenToKVPool, size: int) -> None:
        if size < device_pool.page_size:
            raise ValueError(f"a host KV pool of {size} tokens holds less than one page of {device_pool.page_size}")
        if not device_pool.uniform:
            raise ValueError("the hierarchical cache needs one KV shape for every layer; this model's layers differ")
        self.device_pool = device_pool
        self.page_size = device_pool.page_size
        self.allocator = KVAllocator(size, self.page_size, "cpu")
        self.size = self.allocator.size
        self.device = device_pool.device
        self.on_cuda = self.device.type == "cuda"
        shape = (self.size + self.page_size, device_pool.num_layers, 2, device_pool.num_kv_heads, device_pool.head_dim)
        # Float8 KV travels as its bytes (torch has no index_copy for float8).
        self.storage_dtype = torch.uint8 if device_pool.dtype in FLOAT8_DTYPES else device_pool.dtype
        # torch.empty: pages of RAM are only committed once written.
        self.buffer = torch.empty(shape, dtype=self.storage_dtype, pin_memory=self.on_cuda)
        self._stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        # Pending device -> host copies in issue order: (sequence number, copied, host slots, staging).
        self._writes: list[tuple[int, torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
        self._write_seq = 0  # of the last write issued
        self._last_write_of = torch.zeros(self.size + self.page_size, dtype=torch.int64)  # per host slot
        self._uva = _device_view(self.buffer, self.device) if self.on_cuda else None

    @property
    def bytes_per_token(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    # ---- slots -----------------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Host slots (int64, CPU) for `num_tokens` tokens, or None when the host tier is full."""
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # ---- copies ----------------------------------------------------------------------------------
    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the KV at `device_slots` into `host_slots`."""
        if not self.on_cuda:
            self.buffer[host_slots] = self._gather_device(device_slots)
            return
        if self._uva is not None:
            self._begin(device_slots)
            with torch.cuda.stream(self._stream):
                self._uva.index_copy_(0, host_slots.to(self.device), self._gather_device(device_slots))
            self._fence()
            return
        self._complete_writes(wait_for=0)  # the finished ones, without waiting
        if len(self._writes) >= _MAX_PENDING_WRITES:
            self._complete_writes(wait_for=self._writes[0][0])  # bounds the pinned staging memory held
        self._begin(device_slots)
        with torch.cuda.stream(self._stream):
            staging = torch.empty((len(host_slots), *self.buffer.shape[1:]), dtype=self.buffer.dtype, pin_memory=True)
            staging.copy_(self._gather_device(device_slots), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._write_seq += 1
        self._last_write_of[host_slots] = self._write_seq
        self._writes.append((self._write_seq, copied, host_slots, staging))
        self._fence()

    def read(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV at `host_slots` as a new CPU tensor `[n, layers, 2, heads, dim]` (for the disk tier)."""
        if self._uva is not None:
            self._stream.synchronize()  # the backups the copy stream writes into the buffer
        self._complete_writes_of(host_slots)
        return self.buffer[host_slots]

    def read_device(self, device_slots: torch.Tensor) -> torch.Tensor:
        """The KV at `device_slots` as a new CPU tensor (a demotion straight to disk when the host is full)."""
        return self._gather_device(device_slots).cpu()

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the KV at `host_slots` into the device pool at `device_slots`."""
        self._complete_writes_of(host_slots)
        if not self.on_cuda:
            self._scatter_device(device_slots, self.buffer[host_slots])
            return
        if self._uva is not None:
            self._begin(device_slots)
            with torch.cuda.stream(self._stream):
                self._scatter_device(device_slots, self._uva.index_select(0, host_slots.to(self.device)))
            self._fence()
            return
        staging = torch.empty((len(host_slots), *self.buffer.shape[1:]), dtype=self.buffer.dtype, pin_memory=True)
        torch.index_select(self.buffer, 0, host_slots, out=staging)
        self.load_data(staging, device_slots)

    def load_data(self, data: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy `data` (CPU, `[n, layers, 2, heads, dim]`) into the device pool at `device_slots`."""
        if not self.on_cuda:
            self._scatter_device(device_slots, data)
            return
        if not data.is_pinned():
            data = data.pin_memory()
        self._begin(device_slots)
        with torch.cuda.stream(self._stream):
            self._scatter_device(device_slots, data.to(self.device, non_blocking=True))
        self._fence()

    # ---- helpers ---------------------------------------------------------------------------------
    def _gather_device(self, device_slots: torch.Tensor) -> torch.Tensor:
        pool = self.device_pool
        return torch.stack(
            [torch.stack((self._stored(k)[device_slots], self._stored(v)[device_slots]), dim=1)
             for k, v in zip(pool.k_buffer, pool.v_buffer)],
            dim=1,
        )

    def _scatter_device(self, device_slots: torch.Tensor, data: torch.Tensor) -> None:
        pool = self.device_pool
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
            self._stored(k)[device_slots] = data[:, layer, 0]
            self._stored(v)[device_slots] = data[:, layer, 1]

    def _stored(self, device_buffer: torch.Tensor) -> torch.Tensor:
        """`device_buffer` viewed in the host buffer's dtype (its bytes, for float8)."""
        return device_buffer if device_buffer.dtype == self.storage_dtype else device_buffer.view(self.storage_dtype)

    def _begin(self, device_slots: torch.Tensor) -> None:
        """Before a copy on the copy stream: it sees what the launching stream queued so far (the slot indices
        may still be computed there; the forward of a batch in flight runs on the executor's own stream, so this
        does not wait for it under overlap), and `device_slots` is not reused before the copy ran."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        device_slots.record_stream(self._stream)

    def _fence(self) -> None:
        """Make the stream that launches the next batch wait for every copy queued so far."""
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _complete_writes_of(self, host_slots: torch.Tensor) -> None:
        """Make the buffer hold the latest contents of `host_slots` (waiting for their pending copies only)."""
        if self._writes and len(host_slots):
            self._complete_writes(wait_for=int(self._last_write_of[host_slots].max()))

    def _complete_writes(self, wait_for: int) -> None:
        """Scatter finished device -> host copies into the buffer, in issue order (a host slot freed and reused
        gets its latest contents last): every write up to sequence number `wait_for` (waiting for its copy), then
        those whose copy already finished."""
        done = 0
        for seq, copied, host_slots, staging in self._writes:
            if seq <= wait_for:
                copied.synchronize()
            elif not copied.query():
                break
            self.buffer[host_slots] = staging
            done += 1
        del self._writes[:done]


class _CudaArray:
    """A pointer and shape in the `__cuda_array_interface__` protocol, which torch.as_tensor wraps without a copy."""

    def __init__(self, pointer: int, shape: tuple, typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (pointer, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 3}


def _device_view(buffer: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """A CUDA tensor over the pinned `buffer`'s memory (same shape and dtype), or None where the device cannot
    address it. Checked by a round trip: a value written through the view must be what the host reads."""
    try:
        raw = buffer.view(-1).view(torch.int16) if buffer.element_size() == 2 else buffer.view(-1).view(torch.int32)
        typestr = "<i2" if buffer.element_size() == 2 else "<i4"
        with torch.cuda.device(device):
            flat = torch.as_tensor(_CudaArray(raw.data_ptr(), (raw.numel(),), typestr), device=device)
            view = flat.view(buffer.dtype).view(buffer.shape)
            probe = view.view(-1)[:1]
            saved = buffer.view(-1)[:1].clone()
            probe.copy_(torch.full((1,), 3, dtype=buffer.dtype, device=device))
            torch.cuda.synchronize(device)
            works = buffer.view(-1)[0].item() == 3
            buffer.view(-1)[:1] = saved
        return view if works else None
    except Exception:  # no unified addressing here: the staged copies are used
        return None
