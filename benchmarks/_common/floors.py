"""The floors every checkpoint is compared against, and file chores.

* :func:`copy_floor` — a plain ``copy_`` of tensors into preallocated memory: the host memcpy for host tensors,
  the device-to-host copy (pinned or pageable) for device ones; what any snapshot must at least do.
* :func:`disk_gbps` — parallel ``pwrite`` + ``fsync`` of the same bytes, buffered and ``O_DIRECT``: the disk's
  durable write, what any checkpoint must at least wait for.
* :func:`fsync_tree` — make a peer's files durable (peers that do not fsync are timed to durable this way).
* :func:`drop_cached` — evict files from the page cache, for a cold restore.
* :class:`RawWrites` — the disk's writes alone, again and again, holding off while a training update runs, as a
  guarded engine's writes do: what writing a save costs the update (``bench_overlap.py``, ``bench_pieces.py``).
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MB = 1 << 20


def copy_floor(tensors: Sequence[torch.Tensor], repeat: int, *, to: str | None = None, pin: bool = False,
               warmup: int = 2) -> float:
    """Median seconds of a plain ``copy_`` of every tensor into preallocated, already touched memory.

    Args:
        tensors: the sources.
        repeat: timed copies, after ``warmup`` untimed ones (the first touches the destination's pages).
        to: the destination's device: ``None`` for the sources' own (a memcpy on the host), ``"cpu"`` for the
            device-to-host copy of device tensors.
        pin: page-locked destinations, copied ``non_blocking`` (then the device is synchronized).
    """
    def empty(t: torch.Tensor) -> torch.Tensor:
        if pin:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return torch.empty_like(t, device=to or t.device)

    dst = [empty(t) for t in tensors]
    sync = torch.cuda.synchronize if any(t.is_cuda for t in tensors) else (lambda: None)
    times = []
    for _ in range(repeat + warmup):
        sync()
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t, non_blocking=pin)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def floor_copy(state: dict[str, torch.Tensor], repeat: int) -> float:
    """Seconds of a plain copy_ of every tensor of ``state`` into preallocated (already touched) memory."""
    return copy_floor(list(state.values()), repeat)


def disk_gbps(size: int, out: Path, repeat: int, threads: int = 4, chunk: int = 32 * MB) -> dict[str, float]:
    """GB/s of parallel pwrite + fsync of ``size`` bytes, buffered and O_DIRECT (where the file system takes it)."""
    size = max(size - size % 4096, 4096)
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    for o in range(0, size, MB):
        view[o : o + 16] = os.urandom(16)
    result = {}
    for name, extra in (("buffered", 0), ("O_DIRECT", getattr(os, "O_DIRECT", 0))):
        times = []
        for _ in range(repeat):
            path = out / "disk.bin"
            t0 = time.perf_counter()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra, 0o644)
            except OSError:
                break
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda o, fd=fd: os.pwrite(fd, view[o : o + chunk], o), range(0, size, chunk)))
            os.fsync(fd)
            os.close(fd)
            times.append(time.perf_counter() - t0)
            path.unlink()
        if times:
            result[name] = size / statistics.median(times) / 1e9
    view.release()
    buf.close()
    return result


def files_under(path: Path) -> list[Path]:
    """``path`` itself when it is a file, else every file below it."""
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def fsync_tree(path: Path) -> None:
    """fsync ``path`` (a file) or every file below it."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cached(paths: Iterable[Path]) -> bool:
    """Evict these files (or every file below these directories) from the page cache, after an fsync (only
    clean pages go); ``False`` where the platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        for p in files_under(path):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def disk_seconds(nbytes: int, out: Path, repeat: int) -> float:
    """Seconds the disk takes to write ``nbytes`` durably: :func:`disk_gbps`, the faster of buffered and
    ``O_DIRECT``."""
    return nbytes / max(disk_gbps(nbytes, out, repeat).values()) / 1e9


#: the write floors' chunk (as the engine's: one per write thread at a time) and their threads
CHUNK, THREADS = 32 * MB, 4


def open_for_writes(path: Path) -> int:
    """A file for the floors' writes, created or truncated: ``O_DIRECT`` where the file system takes it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, flags)


def write_pass(pool: ThreadPoolExecutor, fd: int, chunk: Callable[[int], memoryview], nbytes: int,
               turn: threading.Event, *, piece: int, checksum: Callable[[memoryview], object] | None = None,
               checksum_block: int = 256 << 10) -> None:
    """One pass of a floor's writes, then an fsync: ``chunk(offset)`` (:data:`CHUNK` bytes) at every offset below
    ``nbytes``, on ``pool``'s threads, in pwrites of ``piece`` bytes, each waiting while ``turn`` is clear (the
    update runs), as a guarded engine writes; with ``checksum``: first that of every ``checksum_block`` bytes of
    it, each after ``turn`` too, as the engine's writes."""

    def one(at: int) -> None:
        data = chunk(at)
        if checksum is not None:
            for block in range(0, len(data), checksum_block):
                turn.wait()
                checksum(data[block:block + checksum_block])
        for o in range(0, len(data), piece):
            turn.wait()
            os.pwrite(fd, data[o:o + piece], at + o)

    list(pool.map(one, range(0, nbytes, CHUNK)))
    os.fsync(fd)


class RawWrites:
    """The floor of what writing a save costs the update: the state's bytes written again and again as the
    engine writes them (:data:`THREADS` threads of :data:`CHUNK` chunks, each in ``piece``-byte ``O_DIRECT``
    pwrites, an fsync a pass) from one buffer, each pwrite waiting while :attr:`turn` is clear (the update
    runs) — no copy, no checksums, no commit.

    The training thread calls :meth:`start`, then per step :meth:`before_update` and :meth:`after_update`
    around the update, then :meth:`stop`; the writes run on a thread of their own.
    """

    def __init__(self, path: Path, nbytes: int, *, piece: int) -> None:
        self._path, self._piece = path, piece  # piece CHUNK: each chunk in one pwrite
        self.pass_bytes = max(CHUNK, nbytes // CHUNK * CHUNK)  # what one pass writes
        self._buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
        self._buf.write(os.urandom(MB) * (CHUNK // MB))
        self.turn = threading.Event()
        self.turn.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0

    def start(self) -> int:
        """Starts the writes; the passes so far."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self.passes

    def stop(self) -> int:
        """Stops the writes once the pass in flight is done; the passes so far."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.passes

    def before_update(self) -> None:
        self.turn.clear()

    def after_update(self) -> None:
        self.turn.set()

    def _run(self) -> None:
        fd = open_for_writes(self._path)
        view = memoryview(self._buf)
        try:
            with ThreadPoolExecutor(THREADS) as pool:
                while not self._stop.is_set():
                    write_pass(pool, fd, lambda at: view, self.pass_bytes, self.turn, piece=self._piece)
                    self.passes += 1
        finally:
            os.close(fd)
