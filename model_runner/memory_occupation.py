"""Giving memory back between rollouts and training on the same devices, and taking it again (SGLang's
`release_memory_occupation` / `resume_memory_occupation`).

Tags: "kv_cache" (the KV pool's buffers) and "weights" (the model's parameters). Release shrinks each buffer's storage
to nothing (`untyped_storage().resize_(0)`) and resume grows it back, so every tensor and view of it stays the same
object: the attention backend, the model and the pool keep their references. On CUDA the freed blocks go back to the
driver (`torch.cuda.empty_cache`), so `torch.cuda.memory_reserved` falls to what the rest holds.

- The KV pool comes back zeroed; the scheduler dropped the prefix cache before releasing it.
- The weights' bytes go to a backup before their storage is freed: host memory for a device's weights; a file in a
  private temporary folder for CPU weights (there is no cheaper memory to move them to), removed on resume. They come
  back unchanged (the CPU kernels' packed copies are remade from them; those copies are not released).
- A resumed storage lives at a new address, where captured CUDA graphs do not look: decode graphs are captured again
  on resume.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from radixserve.model_runner.weight_update import refresh_weight_copies

logger = logging.getLogger(__name__)


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages of `tensors`, each once (tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MemoryOccupation:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._kv_sizes: Optional[list[tuple[torch.UntypedStorage, int]]] = None
        self._weight_sizes: Optional[list[tuple[torch.UntypedStorage, int]]] = None
        self._weight_backup: Optional[list[torch.Tensor]] = None  # device weights: host copies
        self._weight_folder: Optional[str] = None  # CPU weights: their bytes on disk
        self._graphs_stale = False  # some storage moved since the decode graphs were captured

    def release(self, tags: list[str]) -> None:
        runner = self.runner
        if "kv_cache" in tags and self._kv_sizes is None:
            pool = runner.token_to_kv_pool
            storages = _unique_storages([*pool.k_buffer, *pool.v_buffer])
            self._kv_sizes = [(storage, storage.nbytes()) for storage in storages]
            for storage in storages:
                storage.resize_(0)
        if "weights" in tags and self._weight_sizes is None:
            storages = _unique_storages(list(runner.model.parameters()))
            self._weight_sizes = [(storage, storage.nbytes()) for storage in storages]
            if runner.device.type == "cuda":
                self._weight_backup = [_as_bytes(storage).to("cpu", copy=True).pin_memory() for storage in storages]
            else:
                self._weight_folder = tempfile.mkdtemp(prefix="radixserve-weights-")
                os.chmod(self._weight_folder, 0o700)
                for i, storage in enumerate(storages):
                    # Through a copy: a numpy view would make the storage unresizable for good.
                    _as_bytes(storage).clone().numpy().tofile(os.path.join(self._weight_folder, f"{i}.bin"))
            for storage in storages:
                storage.resize_(0)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            self._graphs_stale = runner.cuda_graph_runner is not None
            runner.cuda_graph_runner = None  # its graphs read the old addresses (and hold their own pool)
            torch.cuda.empty_cache()
        logger.info("released memory: %s", ", ".join(tags))

    def resume(self, tags: list[str]) -> None:
        runner = self.runner
        if "weights" in tags and self._weight_sizes is not None:
            for i, (storage, nbytes) in enumerate(self._weight_sizes):
                storage.resize_(nbytes)
                if self._weight_backup is not None:
                    _as_bytes(storage).copy_(self._weight_backup[i], non_blocking=False)
                else:
                    path = os.path.join(self._weight_folder, f"{i}.bin")
                    _as_bytes(storage).copy_(torch.from_file(path, size=nbytes, dtype=torch.uint8))
            if self._weight_folder is not None:
                shutil.rmtree(self._weight_folder, ignore_errors=True)
            self._weight_sizes = self._weight_backup = self._weight_folder = None
            refresh_weight_copies(runner.model)
        if "kv_cache" in tags and self._kv_sizes is not None:
            for storage, nbytes in self._kv_sizes:
                storage.resize_(nbytes)
                _as_bytes(storage).zero_()
            self._kv_sizes = None
        if self._graphs_stale and not self.released:  # capture runs forwards: every buffer must be back
            runner.cuda_graph_runner = runner._create_cuda_graph_runner()
            self._graphs_stale = False
        logger.info("resumed memory: %s", ", ".join(tags))

    @property
    def released(self) -> list[str]:
        return [tag for tag, sizes in (("kv_cache", self._kv_sizes), ("weights", self._weight_sizes))
                if sizes is not None]
