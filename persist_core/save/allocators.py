"""Where staging buffers come from: the staging pool asks an allocator for page-aligned byte tensors.

:class:`HostAllocator` (the default) takes them from this process's memory, pinned where a device copies into
them. :class:`FileAllocator` maps them from files under a directory (a tmpfs such as ``/dev/shm``): what a save
stages there outlives the process — the seam of the memory tier (issue 42), whose snapshot slots are these
mappings, filled by the staging copy itself."""

from __future__ import annotations

import itertools
import logging
import threading
import mmap
import os
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

import torch

from persist_core._knobs import PAGE_BYTES
from persist_core.errors import ConfigError

log = logging.getLogger(__name__)


class Allocator(Protocol):
    """Hands out page-aligned ``uint8`` tensors of a given size; ``pinned``: they are page-locked."""

    pinned: bool

    def allocate(self, capacity: int) -> torch.Tensor: ...


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

    def path_of(self, tensor: torch.Tensor) -> Path | None:
        """The file ``tensor`` (a buffer this allocator made) is mapped from, or ``None``."""
        return self._path_of.get(tensor.data_ptr())

    def discard(self, tensor: torch.Tensor) -> None:
        """``tensor`` is no longer used (a larger buffer replaces it): its file goes (the mapping, with the tensor)."""
        path = self._path_of.pop(tensor.data_ptr(), None)
        if path is not None:
            path.unlink(missing_ok=True)
            self.paths.remove(path)


class SlotAllocator:
    """The memory tier's staging buffers: mapped from files under ``directory()`` (a :class:`FileAllocator`) while
    the memory tier has room, from this process's memory once it has not (``on_full`` is called once, with the
    reason and whether the directory itself is unusable rather than short of room: the engine warns and goes on
    saving to disk only).

    Args:
        directory: makes (once) and returns the directory of the slots (the memory store's ``open_life``).
        slots: how many buffers the pool holds (the budget is that many of the first size asked for).
        free_bytes: the room left where the slots go.
        make_room: called when the budget does not fit: removes a stopped process's slots (a restart's load has
            read them by the time its saves allocate).
        pin: for the buffers from this process's memory.
    """

    def __init__(self, directory: Callable[[], Path], *, slots: int, free_bytes: Callable[[], int], pin: bool,
                 on_full: Callable[..., None], make_room: Callable[[], None] = lambda: None) -> None:
        self._directory, self._slots, self._free_bytes, self._on_full = directory, slots, free_bytes, on_full
        self._make_room = make_room
        self._files: FileAllocator | None = None
        self._budgeted = False  # the room for the slots was checked (at the first allocation)
        self._host = HostAllocator(pin=pin)
        self._pin = pin
        self.full = False
        self.pinned = False
        self._lock = threading.Lock()

    def allocate(self, capacity: int) -> torch.Tensor:
        with self._lock:  # a save's thread and the warm-up's may allocate at once
            return self._allocate(capacity)

    def fits(self, capacity: int) -> bool:
        """Whether the budget for slots of ``capacity`` would fit (a stopped process's slots removed first where it
        would not); ``True`` once the budget is decided (by the first allocation, or the tier ran out of room)."""
        with self._lock:
            if self.full or self._files is not None:
                return True
            try:
                self._directory()
                if self._slots * capacity > self._free_bytes():
                    self._make_room()
                return self._slots * capacity <= self._free_bytes()
            except (ConfigError, OSError):
                return True  # the first allocation says why, and warns

    def _allocate(self, capacity: int) -> torch.Tensor:
        if not self.full and self._files is None:
            try:
                self._files = FileAllocator(self._directory())
            except (ConfigError, OSError) as e:  # a link, another user's, cannot be made: said, with the fix
                self.full = True
                self._on_full(str(e), unusable=True)
        if not self.full:
            assert self._files is not None
            try:
                if not self._budgeted:
                    self._budgeted = True
                    need = self._slots * capacity
                    if need > self._free_bytes():  # a restart: the stopped process's slots go first (read by now)
                        self._make_room()
                    if need > self._free_bytes():
                        raise ConfigError(f"{self._files.directory} has {self._free_bytes()} bytes free, the memory "
                                          f"tier needs {need} ({self._slots} slots of {capacity} bytes)")
                tensor = self._files.allocate(capacity)
                if self._pin:
                    self._register(tensor)
                return tensor
            except (ConfigError, OSError) as e:
                self.full = True
                self._on_full(str(e), unusable=False)
        return self._host.allocate(capacity)

    def _register(self, tensor: torch.Tensor) -> None:
        """Page-lock a mapped slot for the device's copies (``cudaHostRegister``), as pinned buffers are."""
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
        if int(rc) != 0:
            log.info("cudaHostRegister of a memory-tier slot failed (%s): its device copies are not pinned", rc)

    def path_of(self, tensor: torch.Tensor) -> Path | None:
        return None if self._files is None else self._files.path_of(tensor)

    def discard(self, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._files is not None:
                self._files.discard(tensor)
