"""The memory tier's staging buffers (issue 42): the slots a snapshot is staged into, mapped from files in the
memory store's directory while the tier has room, from this process's memory once it has not."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from persist_core.errors import ConfigError
from persist_core.memory.store import MemoryStore
from persist_core.staging.allocators import FileAllocator, HostAllocator

log = logging.getLogger(__name__)


class SlotAllocator:
    """The memory tier's staging buffers: mapped from files under ``directory()`` (a :class:`FileAllocator`) while
    the memory tier has room, from this process's memory once it has not (``on_full`` is called once, with the
    reason and whether the directory itself is unusable rather than short of room: the engine warns and goes on
    saving to disk only).

    Args:
        store: this rank's snapshots: it makes (once) the slots' directory (``open_life``), says the room left
            (``free_bytes``), makes room when the budget does not fit (``remove_other_lives``: a stopped process's
            slots, which a restart's load has read by the time its saves allocate), and drops a slot's record
            before the slot is overwritten (``drop``, from :meth:`reusing`).
        slots: how many buffers the pool holds (the budget is that many of the first size asked for).
        pin: for the buffers from this process's memory.
        on_full: called once when the slots cannot be had (the reason; ``unusable``: the directory, not its room).
    """

    def __init__(self, store: MemoryStore, *, slots: int, pin: bool, on_full: Callable[..., None]) -> None:
        self._store, self._slots, self._on_full = store, slots, on_full
        self._directory, self._free_bytes, self._make_room = store.open_life, store.free_bytes, store.remove_other_lives
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

    def reusing(self, tensor: torch.Tensor) -> None:
        """The pool is about to overwrite ``tensor``: the record of the snapshot it holds goes first."""
        path = self.path_of(tensor)
        if path is not None:
            self._store.drop(path)

    def path_of(self, tensor: torch.Tensor) -> Path | None:
        return None if self._files is None else self._files.path_of(tensor)

    def discard(self, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._files is not None:
                self._files.discard(tensor)
