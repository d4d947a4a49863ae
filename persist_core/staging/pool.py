"""Host staging buffers, reused across saves (the copy of a state into them: :mod:`persist_core.staging.stage`).

The engine calls :func:`~persist_core.staging.stage.stage_into` from ``save()`` (:meth:`StagingPool.acquire`, then
:func:`~persist_core.staging.stage.stage`), and :meth:`StagingPool.release` from the writer once the shard is on disk. One buffer is one shard
file image (header + data section), so writing is ``pwrite`` straight from it.

Overlap: when every buffer is still being written, ``acquire`` may hand out one whose writer
reports its progress (:meth:`StagingPool.writing`, :meth:`StagingPool.chunk_written`);
:func:`~persist_core.staging.stage.stage` then copies each byte range only once the writer is done with it, so the next
save's copy runs right behind the previous write instead of after all of it — without a
second copy of the state in memory.

Buffers are page-aligned (``O_DIRECT`` needs that) and pinned when CUDA is available, so the
device-to-host copy of CUDA tensors runs ``non_blocking`` on a side stream.

Warm-up: a buffer's first copy also faults in each of its pages (here 2.7x a copy into a reused
buffer, and up to 20x in a fresh process, whose memory the VM backs on first touch), so the first
save of each restarted job would make its update wait. :meth:`StagingPool.warm` allocates the
buffers not yet allocated and faults their pages in (``MADV_POPULATE_WRITE``, which leaves their
bytes alone, so a save may copy into a buffer still being warmed) on a background thread; the
engine calls it once a load says how large the next saves are.
"""

from __future__ import annotations

import logging
import threading
import time

from persist_core import hostmem
from persist_core.turn import NO_TURN, Turn
from persist_core.staging.allocators import Allocator, HostAllocator

log = logging.getLogger(__name__)


_ALL = float("inf")
_HEADROOM_ALIGN = 2 << 20  # a warmed buffer is rounded up to this, plus 1/64, so a slightly larger state fits


class StagingBuffer:
    """One reusable, page-aligned host byte buffer."""

    def __init__(self, capacity: int, *, pin: bool = False, allocator: Allocator | None = None) -> None:
        allocator = allocator or HostAllocator(pin=pin)
        self.tensor = allocator.allocate(capacity)
        self.capacity = capacity
        self.pinned = allocator.pinned
        self.layout: bytes | None = None  # the header of the plan whose padding this buffer holds zeroed
        # guarded by the pool's lock: bytes [0, freed) the previous save no longer needs; the
        # chunks written beyond that prefix; whether the next save has claimed the buffer
        self._freed: float = _ALL
        self._done: dict[int, int] = {}
        self._claimed = False
        self._kept = 0  # held by the memory tier (a snapshot it keeps, or one it is committing): never handed out

    def memoryview(self, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` (no copy); valid while this buffer lives."""
        return hostmem.raw_view(self.tensor.data_ptr(), nbytes)


class StagingPool:
    """At most ``slots`` buffers; ``acquire`` blocks while all are in use (back-pressure).

    Who calls what: ``save()`` calls :meth:`acquire`, :meth:`wait_free` (through :func:`stage`)
    and, if staging fails, :meth:`abandon`; the writer calls :meth:`writing` before it writes a
    buffer, :meth:`chunk_written` per chunk on disk, and :meth:`release` when done.

    Args:
        slots: how many checkpoints may be staged or writing at once.
        pin: pin buffers (page-locked) for fast, asynchronous device-to-host copies.
        turn: the warm-up's page faults hold off while a guarded update has the host.
        allocator: where the buffers come from (default: this process's memory, pinned if ``pin``); told of a
            buffer about to be overwritten by a save (the memory tier's drops its record first).
    """

    def __init__(self, slots: int, *, pin: bool, turn: Turn = NO_TURN, allocator: Allocator | None = None) -> None:
        self._free: list[StagingBuffer | None] = [None] * slots  # None: a slot not allocated yet
        self._writing: list[StagingBuffer] = []  # being written, with progress reported
        self._cond = threading.Condition()
        self._allocator = allocator or HostAllocator(pin=pin)
        self._turn = turn  # the warm-up's page faults hold off while a guarded update runs
        self._warming: threading.Thread | None = None
        self._closed = False

    def acquire(self, nbytes: int, *, claim: bool = True) -> tuple[StagingBuffer, float]:
        """A buffer of at least ``nbytes`` and the seconds spent waiting for it.

        A free buffer when there is one (never one the memory tier keeps); else (``claim``) one still being
        written (claimed, so only one save follows each write), whose bytes :meth:`wait_free` hands over as they
        are written.
        """
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._usable() is not None
                                or (claim and self._claimable(nbytes) is not None))
            i = self._usable()
            if i is not None:
                buf = self._free.pop(i)
            else:
                buf = self._claimable(nbytes)
                buf._claimed = True
                self._reuse(buf)
                return buf, time.perf_counter() - t0
        waited = time.perf_counter() - t0
        if buf is not None:
            self._reuse(buf)
        if buf is None or buf.capacity < nbytes:
            log.debug("allocating a %s staging buffer of %d bytes", type(self._allocator).__name__, nbytes)
            if buf is not None and hasattr(self._allocator, "discard"):
                self._allocator.discard(buf.tensor)  # a mapped file: its room goes back
            buf = None  # let the old one go before allocating the new one
            buf = StagingBuffer(nbytes, allocator=self._allocator)
            self.warm(nbytes)  # the slots still unallocated, for the next saves (max_pending > 1)
        return buf, waited

    def warm(self, nbytes: int) -> threading.Thread | None:
        """Allocate the slots not allocated yet for shards of about ``nbytes`` (with some headroom) and
        fault their pages in, on a background thread; that thread, or ``None`` when there is nothing to do
        (every slot allocated, a warm-up running, or too little free memory: a log line says so)."""
        capacity = -(-(nbytes + nbytes // 64) // _HEADROOM_ALIGN) * _HEADROOM_ALIGN
        with self._cond:
            if self._closed or nbytes <= 0 or None not in self._free or self._warming is not None:
                return None
            slots = self._free.count(None)
            if not hostmem.fits(slots * capacity):
                log.info("not warming %d staging buffer(s) of %d bytes: less memory is available; the first "
                         "save's copy faults its pages in", slots, capacity)
                return None
            fits = getattr(self._allocator, "fits", None)  # the memory tier's budget: sized by the first allocation
            if fits is not None and not fits(capacity):  # headroom must not turn a tier that fits the state off
                log.info("not warming the memory tier's slots at %d bytes (with headroom): its room fits less; the "
                         "first snapshot sizes them", capacity)
                return None
            self._warming = threading.Thread(target=self._warm, args=(capacity,), name="persist-warm", daemon=True)
            self._warming.start()
            return self._warming

    def _warm(self, capacity: int) -> None:
        hostmem.idle_priority()  # only cores nothing else wants: not the load's, not the training's
        try:
            while True:
                with self._cond:
                    if self._closed or None not in self._free:
                        return
                    self._free.remove(None)  # this slot is being allocated (acquire waits for it, or takes another)
                try:
                    buf: StagingBuffer | None = StagingBuffer(capacity, allocator=self._allocator)
                except BaseException as e:  # too little memory: the first save allocates as before
                    log.info("could not warm a staging buffer of %d bytes: %s", capacity, e)
                    buf = None
                with self._cond:
                    self._free.append(buf)
                    self._cond.notify_all()
                if buf is None:
                    return
                if not buf.pinned:  # pinning (cudaHostAlloc) faults its pages in already
                    hostmem.populate(buf.tensor.data_ptr(), buf.capacity, turn=self._turn.wait, stop=lambda: self._closed)
        finally:
            with self._cond:
                self._warming = None

    def close(self) -> None:
        """Stop a warm-up (between two of its steps); the buffers stay usable."""
        with self._cond:
            self._closed = True
            warming = self._warming
        if warming is not None:
            warming.join()

    def _claimable(self, nbytes: int) -> StagingBuffer | None:
        return next((b for b in self._writing if not b._claimed and not b._kept and b.capacity >= nbytes), None)

    def _usable(self) -> int | None:
        """The index in the free list of the buffer to hand out (the last one not kept), or ``None``."""
        return next((i for i in range(len(self._free) - 1, -1, -1)
                     if self._free[i] is None or not self._free[i]._kept), None)

    def _reuse(self, buf: StagingBuffer) -> None:
        self._allocator.reusing(buf.tensor)

    def keep(self, buf: StagingBuffer) -> None:
        """The memory tier holds ``buf`` (a snapshot): no save overwrites it until :meth:`unkeep`."""
        with self._cond:
            buf._kept += 1

    def unkeep(self, buf: StagingBuffer) -> None:
        with self._cond:
            buf._kept -= 1
            self._cond.notify_all()

    def wait_free(self, buf: StagingBuffer, end: int) -> float:
        """Block until bytes ``[0, end)`` of ``buf`` may be overwritten; returns the seconds waited."""
        if buf._freed >= end:  # the usual case, without the lock: _freed only grows while a save stages
            return 0.0
        with self._cond:
            if buf._freed >= end:
                return 0.0
            t0 = time.perf_counter()
            self._cond.wait_for(lambda: buf._freed >= end)
            return time.perf_counter() - t0

    def writing(self, buf: StagingBuffer) -> None:
        """The writer starts writing ``buf`` and will report each chunk with :meth:`chunk_written`."""
        with self._cond:
            buf._freed, buf._done = 0, {}
            self._writing.append(buf)
            self._cond.notify_all()

    def chunk_written(self, buf: StagingBuffer, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of ``buf`` are on disk and checksummed."""
        with self._cond:
            buf._done[offset] = length
            while buf._freed in buf._done:
                buf._freed += buf._done.pop(buf._freed)
            self._cond.notify_all()

    def release(self, buf: StagingBuffer) -> None:
        """The writer is done with ``buf``: to the save that claimed it, or back for reuse."""
        with self._cond:
            if buf in self._writing:
                self._writing.remove(buf)
            buf._freed, buf._done = _ALL, {}
            if buf._claimed:
                buf._claimed = False  # it belongs to the claiming save (and its writer) now
            else:
                self._free.append(buf)
            self._cond.notify_all()

    def abandon(self, buf: StagingBuffer) -> None:
        """``save()`` gives up ``buf`` before handing it to the writer (its staging failed)."""
        with self._cond:
            if buf in self._writing and buf._claimed:
                buf._claimed = False  # its writer still owns it and releases it
            else:
                buf._freed, buf._done = _ALL, {}
                self._free.append(buf)
            self._cond.notify_all()
