"""Where staging buffers come from: the staging pool asks an allocator for page-aligned byte tensors.

:class:`HostAllocator` (the default) takes them from this process's memory, pinned where a device copies into
them. :class:`FileAllocator` maps them from files under a directory (a tmpfs such as ``/dev/shm``): what a save
stages there outlives the process — the seam of the memory tier (issue 42), whose snapshot slots are these
mappings, filled by the staging copy itself (:class:`persist_core.memory.slots.SlotAllocator`)."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
from pathlib import Path
from typing import Protocol

import torch

from persist_core._knobs import PAGE_BYTES
from persist_core.errors import ConfigError

log = logging.getLogger(__name__)


class Allocator(Protocol):
    """Hands out page-aligned ``uint8`` tensors of a given size; ``pinned``: they are page-locked."""

    pinned: bool

    def allocate(self, capacity: int) -> torch.Tensor: ...

    def reusing(self, tensor: torch.Tensor) -> None:
        """``tensor`` (a buffer this allocator made) is about to be overwritten by a save."""


class HostAllocator:
    """Buffers in this process's memory; pinned (``cudaHostAlloc``) when ``pin``."""

    def __init__(self, *, pin: bool) -> None:
        self.pinned = pin

    def allocate(self, capacity: int) -> torch.Tensor:
        if self.pinned:
            return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)  # page-aligned
        raw = torch.empty(capacity + PAGE_BYTES, dtype=torch.uint8)
        skew = -raw.data_ptr() % PAGE_BYTES
        return raw[skew : skew + capacity]

    def reusing(self, tensor: torch.Tensor) -> None:
        """Nothing to do: a host buffer holds nothing anyone reads again."""


class FileAllocator:
    """Buffers mapped (shared) from files ``slot-N`` under ``directory``, each created mode 0600 (never through a
    link: ``O_EXCL | O_NOFOLLOW``) and given its blocks up front (``posix_fallocate``): a tmpfs too small for it
    fails here, with a ``ConfigError``, never later with a SIGBUS in the middle of a copy.

    Args:
        directory: where the files go (created, mode 0700); a tmpfs keeps them in memory.
        prefix: the files' names begin with it.
    """

    pinned = False

    def __init__(self, directory: str | os.PathLike[str], *, prefix: str = "slot-") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._prefix = prefix
        self._numbers = itertools.count()
        self.paths: list[Path] = []
        self._path_of: dict[int, Path] = {}

    def allocate(self, capacity: int) -> torch.Tensor:
        path = self.directory / f"{self._prefix}{next(self._numbers)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, capacity)
            except OSError as e:
                os.unlink(path)
                raise ConfigError(f"cannot reserve {capacity} bytes for a staging buffer in {self.directory} ({e}); "
                                  "give that file system more room or map the buffers elsewhere") from e
            mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.paths.append(path)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive; page-aligned
        self._path_of[tensor.data_ptr()] = path
        return tensor

    def reusing(self, tensor: torch.Tensor) -> None:
        """Nothing to do: what a file holds is its reader's business (the memory tier's :class:`SlotAllocator`)."""

    def path_of(self, tensor: torch.Tensor) -> Path | None:
        """The file ``tensor`` (a buffer this allocator made) is mapped from, or ``None``."""
        return self._path_of.get(tensor.data_ptr())

    def discard(self, tensor: torch.Tensor) -> None:
        """``tensor`` is no longer used (a larger buffer replaces it): its file goes (the mapping, with the tensor)."""
        path = self._path_of.pop(tensor.data_ptr(), None)
        if path is not None:
            path.unlink(missing_ok=True)
            self.paths.remove(path)
