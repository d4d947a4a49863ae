"""Host memory: how much is available, faulting pages in ahead of use, a thread that runs only on idle cores,
and copies on the engine's own threads that start no parallel team.

Used by the staging pool's warm-up (:meth:`persist_core.staging.pool.StagingPool.warm`). Linux only in effect;
elsewhere each function does nothing (and says so in a debug line) and the first copy faults pages in.
:func:`copy_here` is for the background copy of guarded saves and the reader's threads; :func:`raw_view` is the bytes at
an address, as the staging buffers and the incremental hash read them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from collections.abc import Callable

import torch

from persist_core.format.shape import plain_tensor

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, their contents untouched
_POPULATE_BYTES = 4 << 20  # per madvise call (which holds the mmap lock an allocation needs); yields between calls

_libc: ctypes.CDLL | None = None


def raw_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address`` (no copy); valid while what owns that memory lives."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def fits(nbytes: int) -> bool:
    """Whether ``nbytes`` more leave a quarter of the host's available memory free (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True  # not Linux: nothing to go by, as without a warm-up
    return nbytes <= avail * 3 // 4


def idle_priority() -> None:
    """Run the calling thread only when a core is otherwise idle (Linux ``SCHED_IDLE``; elsewhere a no-op)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread
    except (AttributeError, OSError) as e:
        log.debug("the warm-up runs at normal priority: %s", e)


def populate(address: int, nbytes: int, *, turn: Callable[[], None], stop: Callable[[], bool]) -> bool:
    """Fault in the pages of ``[address, address + nbytes)`` (page-aligned; writable, bytes unchanged),
    ``_POPULATE_BYTES`` at a time, each after ``turn()``; whether all were. Stops early on ``stop()`` or where
    the kernel lacks ``MADV_POPULATE_WRITE`` (then the first write faults the rest in, as without it)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    madvise = _libc.madvise
    t0 = time.perf_counter()
    for offset in range(0, nbytes, _POPULATE_BYTES):
        if stop():
            return False
        turn()
        length = min(_POPULATE_BYTES, nbytes - offset)
        if madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()  # EINVAL: a kernel before 5.14
            log.log(logging.DEBUG if code in (errno.EINVAL, errno.ENOSYS) else logging.INFO,
                    "faulting pages in stopped: madvise(MADV_POPULATE_WRITE): %s", os.strerror(code))
            return False
    log.debug("faulted in %d bytes in %.3f s", nbytes, time.perf_counter() - t0)
    return True


_SERIAL = 32768  # at::internal::GRAIN_SIZE: a copy of at most this many elements runs on the calling thread alone
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass: its data_ptr() is its bytes


def copy_here(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors, run on the calling thread alone: for the engine's own threads.

    A parallel torch op from any thread but the main one makes OpenMP start a second team of worker threads
    for that thread, kept while it lives; once the process holds more OpenMP threads than cores, every
    parallel region of the training (an optimizer step, a matmul) wakes its workers the slow way — on two
    cores the in-place update of a 0.3 GB model took 46 ms instead of 25, for the rest of the run. So the
    bytes of a contiguous source of ``dst``'s dtype are one ``memmove`` (which releases the GIL; as fast as
    a two-thread ``copy_``: memory-bound), anything else goes in pieces too small to run in parallel. A
    copy to or from a device is the device's (``copy_``, as asked).
    """
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    if (type(src) in _PLAIN and plain_tensor(src) and src.dtype == dst.dtype and src.is_contiguous()
            and dst.is_contiguous() and src.shape == dst.shape):
        if src.numel():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        return
    if src.numel() <= _SERIAL or src.dim() == 0:
        dst.copy_(src)
        return
    src = src.expand_as(dst)  # as copy_ broadcasts
    per = src[0].numel() if src.dim() > 1 else 1
    if per > _SERIAL:
        for i in range(src.shape[0]):
            copy_here(dst[i], src[i])
        return
    rows = _SERIAL // per
    for i in range(0, src.shape[0], rows):
        dst[i : i + rows].copy_(src[i : i + rows])
