"""Host staging buffers, reused across saves, and the copy of a state into them.

The engine calls :meth:`StagingPool.acquire` from ``save()``, :func:`stage` to copy, and
:meth:`StagingPool.release` from the writer once the shard is on disk. One buffer is one shard
file image (header + data section), so writing is ``pwrite`` straight from it.

Buffers are page-aligned (``O_DIRECT`` needs that) and pinned when CUDA is available, so the
device-to-host copy of CUDA tensors runs ``non_blocking`` on a side stream.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from persist_core._knobs import PAGE_BYTES
from persist_core.format import ShardPlan

log = logging.getLogger(__name__)


class StagingBuffer:
    """One reusable, page-aligned host byte buffer."""

    def __init__(self, capacity: int, *, pin: bool) -> None:
        if pin:
            self.tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)  # page-aligned
        else:
            raw = torch.empty(capacity + PAGE_BYTES, dtype=torch.uint8)
            skew = -raw.data_ptr() % PAGE_BYTES
            self.tensor = raw[skew : skew + capacity]
        self.capacity = capacity
        self.pinned = pin

    def memoryview(self, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` (no copy); valid while this buffer lives."""
        return memoryview((ctypes.c_char * nbytes).from_address(self.tensor.data_ptr())).cast("B")


class StagingPool:
    """At most ``slots`` buffers; ``acquire`` blocks while all are in use (back-pressure).

    Args:
        slots: how many checkpoints may be staged or writing at once.
        pin: pin buffers (page-locked) for fast, asynchronous device-to-host copies.
    """

    def __init__(self, slots: int, *, pin: bool) -> None:
        self._free: list[StagingBuffer | None] = [None] * slots
        self._cond = threading.Condition()
        self._pin = pin

    def acquire(self, nbytes: int) -> tuple[StagingBuffer, float]:
        """A buffer of at least ``nbytes`` and the seconds spent waiting for a free slot."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            buf = self._free.pop()
        waited = time.perf_counter() - t0
        if buf is None or buf.capacity < nbytes:
            log.debug("allocating a %s staging buffer of %d bytes", "pinned" if self._pin else "host", nbytes)
            buf = None  # let the old one go before allocating the new one
            buf = StagingBuffer(nbytes, pin=self._pin)
        return buf, waited

    def release(self, buf: StagingBuffer) -> None:
        """Give ``buf`` back for reuse by the next save."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


def stage(plan: ShardPlan, buf: StagingBuffer, streams: dict[torch.device, torch.cuda.Stream]) -> None:
    """Copy ``plan``'s header and sources into ``buf``; returns once the bytes are there.

    CUDA sources are copied ``non_blocking`` on a per-device side stream (created on demand in
    ``streams``) that first waits for the device's current stream; the call waits for those
    copies before returning, so the caller may mutate its tensors afterwards.
    """
    data = buf.tensor[: plan.file_bytes]
    ctypes.memmove(data.data_ptr(), plan.header, len(plan.header))
    base = len(plan.header)
    used: list[torch.cuda.Stream] = []
    for c in plan.copies:
        dst = data[base + c.begin : base + c.end]
        src = c.source
        if isinstance(src, bytes):
            ctypes.memmove(dst.data_ptr(), src, len(src))
            continue
        if c.dtype != torch.uint8:
            dst = dst.view(c.dtype)
        dst = dst.view(c.shape)
        if src.is_cuda:
            stream = streams.get(src.device)
            if stream is None:
                stream = streams[src.device] = torch.cuda.Stream(device=src.device)
            if stream not in used:
                stream.wait_stream(torch.cuda.current_stream(src.device))
                used.append(stream)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
    for stream in used:
        stream.synchronize()
