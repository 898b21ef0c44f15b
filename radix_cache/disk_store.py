"""The disk tier of the hierarchical cache (`--hicache-storage-dir`): KV of tree nodes demoted from the host tier,
one file per node.

Files live in a private folder created under the given directory and removed with the store (at `close`, or when
the process exits), so two servers pointed at the same directory never see each other's files. The contents are
the `[n, layers, 2, heads, dim]` block of `HostKVPool.read`. A write that fails (a full or read-only disk) is
reported as None, and the caller drops the node instead of demoting it.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from typing import NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)


class DiskRef(NamedTuple):
    """Where a node's KV lies on disk: tokens from `offset` on in `file` (a split node's parts share a file)."""

    file: str
    offset: int


class DiskKVStore:
    """Node KV files under `root`; `capacity` tokens at most (None: as many as the disk takes).

    A file is shared by the parts of a node split after it was written, and removed when the last part releases
    it; `used` counts the tokens of the files on disk, which is what the capacity bounds.
    """

    def __init__(self, root: str, capacity: Optional[int] = None) -> None:
        os.makedirs(root, exist_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix="radixserve-hicache-", dir=root)
        self.path = self._dir.name
        self.capacity = capacity
        self._names = itertools.count()
        self._files: dict[str, list[int]] = {}  # file -> [tokens it holds, references]
        self.used = 0

    def has_room(self, num_tokens: int) -> bool:
        return self.capacity is None or self.used + num_tokens <= self.capacity

    def put(self, data: torch.Tensor) -> Optional[DiskRef]:
        """Write one node's KV; returns where it lies, or None when the write failed."""
        file = os.path.join(self.path, f"{next(self._names)}.kv")
        try:
            torch.save(data.contiguous(), file)
        except OSError as exc:
            logger.warning("hierarchical cache: writing %s failed (%s); the node is dropped instead", file, exc)
            if os.path.exists(file):
                os.remove(file)
            return None
        self._files[file] = [len(data), 1]
        self.used += len(data)
        return DiskRef(file, 0)

    def get(self, ref: DiskRef, num_tokens: int) -> torch.Tensor:
        data = torch.load(ref.file, map_location="cpu", weights_only=True)
        return data[ref.offset:ref.offset + num_tokens]

    def split(self, ref: DiskRef, length: int) -> tuple[DiskRef, DiskRef]:
        """The references of the two parts of a node cut after `length` tokens (no I/O)."""
        self._files[ref.file][1] += 1
        return ref, DiskRef(ref.file, ref.offset + length)

    def release(self, ref: DiskRef) -> None:
        """Drop one reference; the file goes with the last."""
        entry = self._files[ref.file]
        entry[1] -= 1
        if entry[1] == 0:
            del self._files[ref.file]
            self.used -= entry[0]
            os.remove(ref.file)

    def references(self) -> dict[str, int]:
        """References per file (for invariant checks)."""
        return {file: entry[1] for file, entry in self._files.items()}

    def close(self) -> None:
        self._files.clear()
        self.used = 0
        self._dir.cleanup()
