"""What several benchmarks measure alike: the floors every checkpoint is compared against, and file chores.

* :func:`copy_floor` — a plain ``copy_`` of tensors into preallocated memory: the host memcpy for host tensors,
  the device-to-host copy (pinned or pageable) for device ones; what any snapshot must at least do.
* :func:`disk_gbps` — parallel ``pwrite`` + ``fsync`` of the same bytes, buffered and ``O_DIRECT``: the disk's
  durable write, what any checkpoint must at least wait for.
* :func:`fsync_tree` — make a peer's files durable (peers that do not fsync are timed to durable this way).
* :func:`drop_cached` — evict files from the page cache, for a cold restore.

Each benchmark puts the repository root on ``sys.path`` and imports this as ``benchmarks._common``.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Iterable, Sequence
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
