"""Host staging buffers, reused across saves, and the copy of a state into them.

The engine calls :func:`stage_into` from ``save()`` (:meth:`StagingPool.acquire`, then :func:`stage`), and
:meth:`StagingPool.release` from the writer once the shard is on disk. One buffer is one shard
file image (header + data section), so writing is ``pwrite`` straight from it.

Overlap: when every buffer is still being written, ``acquire`` may hand out one whose writer
reports its progress (:meth:`StagingPool.writing`, :meth:`StagingPool.chunk_written`);
:func:`stage` then copies each byte range only once the writer is done with it, so the next
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

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from persist_core import hostmem
from persist_core.errors import PersistError
from persist_core.planning.save import EntryCopy, ShardPlan
from persist_core.turn import NO_TURN, Turn
from persist_core.save.allocators import Allocator, HostAllocator

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
        return memoryview((ctypes.c_char * nbytes).from_address(self.tensor.data_ptr())).cast("B")


class StagingPool:
    """At most ``slots`` buffers; ``acquire`` blocks while all are in use (back-pressure).

    Who calls what: ``save()`` calls :meth:`acquire`, :meth:`wait_free` (through :func:`stage`)
    and, if staging fails, :meth:`abandon`; the writer calls :meth:`writing` before it writes a
    buffer, :meth:`chunk_written` per chunk on disk, and :meth:`release` when done.

    Args:
        slots: how many checkpoints may be staged or writing at once.
        pin: pin buffers (page-locked) for fast, asynchronous device-to-host copies.
        turn: the warm-up's page faults hold off while a guarded update has the host.
        allocator: where the buffers come from (default: this process's memory, pinned if ``pin``).
        reusing: called with a buffer about to be overwritten by a save (the memory tier drops its record first).
    """

    def __init__(self, slots: int, *, pin: bool, turn: Turn = NO_TURN, allocator: Allocator | None = None,
                 reusing: Callable[[StagingBuffer], None] | None = None) -> None:
        self._free: list[StagingBuffer | None] = [None] * slots  # None: a slot not allocated yet
        self._reusing = reusing
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
        if self._reusing is not None:
            self._reusing(buf)

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


def stage(plan: ShardPlan, buf: StagingBuffer, streams: dict[torch.device, torch.cuda.Stream],
          wait_free: Callable[[int], float] = lambda end: 0.0,
          defer: Callable[[EntryCopy], bool] | None = None,
          skip: Callable[[EntryCopy], bool] | None = None) -> tuple[float, Callable[[], float] | None]:
    """Copy ``plan``'s header and sources into ``buf``; returns once the bytes are there.

    CUDA sources are copied ``non_blocking`` on a per-device side stream (created on demand in
    ``streams``) that first waits for the device's current stream; the call waits for those
    copies before returning, so the caller may mutate its tensors afterwards. Before each range
    is written, ``wait_free(end)`` blocks until bytes ``[0, end)`` of ``buf`` may be overwritten.

    With ``defer``, the copies it picks are left out and returned as a function that makes them
    (the overlap: a background thread runs it while training goes on; the side stream waits for an
    event recorded now, on the caller's stream, so the copies see exactly the values of this moment).
    The copies ``skip`` picks are not made at all (an incremental save's unchanged tensors: their range of ``buf``
    keeps whatever it held, and is never written).

    Returns:
        ``(seconds spent in wait_free, the deferred copies' function or None)``; that function
        returns its own seconds spent in ``wait_free``.
    """
    data = buf.tensor[: plan.file_bytes]
    # the data section's padding is zeroed: no stale memory reaches the file, and equal states give equal bytes;
    # a buffer last staged with this very layout (a cached plan's header) holds it zeroed already
    zero = buf.layout is not plan.header
    buf.layout = None  # until this staging is done
    waited = wait_free(len(plan.header))
    ctypes.memmove(data.data_ptr(), plan.header, len(plan.header))
    base = len(plan.header)
    later: list[EntryCopy] = []
    used: list[torch.cuda.Stream] = []
    pos = 0
    for c in plan.copies:  # in file order, so each range waits only for the previous write to pass it
        if zero and c.begin > pos:
            waited += wait_free(base + c.begin)
            ctypes.memset(data.data_ptr() + base + pos, 0, c.begin - pos)
        pos = c.end
        if skip is not None and skip(c):
            continue
        if defer is not None and defer(c):
            later.append(c)
        else:
            waited += _copy(c, data, base, streams, wait_free, used, events={})
    if zero and plan.file_bytes > base + pos:
        waited += wait_free(plan.file_bytes)
        ctypes.memset(data.data_ptr() + base + pos, 0, plan.file_bytes - base - pos)
    buf.layout = plan.header
    for stream in used:
        stream.synchronize()
    if not later:
        return waited, None
    events = {}  # the moment of save(): each device's current stream, for the deferred copies to wait on
    for device in {c.source.device for c in later if isinstance(c.source, torch.Tensor) and c.source.is_cuda}:
        events[device] = torch.cuda.Event()
        events[device].record(torch.cuda.current_stream(device))
    versions = [_version(c.source) for c in later]  # the moment of save(): an in-place change bumps them
    return waited, lambda: _copy_all(later, data, base, streams, wait_free, events=events, versions=versions)


def _version(source: torch.Tensor | bytes) -> int | None:
    """The tensor's version counter (autograd's: every in-place op bumps it), or ``None``."""
    return getattr(source, "_version", None) if isinstance(source, torch.Tensor) else None


def _copy_all(copies: list[EntryCopy], data: torch.Tensor, base: int, streams: dict[torch.device, torch.cuda.Stream],
              wait_free: Callable[[int], float], *, events: dict[torch.device, torch.cuda.Event],
              versions: list[int | None] | None = None) -> float:
    """Copy each of ``copies`` into ``data`` (CUDA ones on side streams, waited for); seconds in ``wait_free``.

    With ``versions`` (each source's version counter at ``save()``), a source changed in place since then —
    before its copy, or while it ran — fails the copy: the checkpoint would mix two moments.

    Raises:
        PersistError: a source was changed in place after ``save()``, before the guard's fence.
    """
    used: list[torch.cuda.Stream] = []
    waited = 0.0
    for i, c in enumerate(copies):
        if versions is not None:
            _check_unchanged(c, versions[i])
        waited += _copy(c, data, base, streams, wait_free, used, events=events, here=True)
    for stream in used:
        stream.synchronize()
    if versions is not None:  # and none changed while its copy ran
        for c, v in zip(copies, versions):
            _check_unchanged(c, v)
    return waited


def _check_unchanged(c: EntryCopy, version: int | None) -> None:
    if version is not None and _version(c.source) != version:
        raise PersistError(
            f"state entry {c.name or '?'} was changed in place after save() and before its background copy "
            f"(version {version} -> {_version(c.source)}): the checkpoint would mix two steps, so it is not "
            "written. Only the guarded optimizers' step waits for the copy (engine.guard(...)); call "
            "engine.fence() (or handle.wait_staged()) before anything else changes parameters or optimizer "
            "state in place")


def _copy(c: EntryCopy, data: torch.Tensor, base: int, streams: dict[torch.device, torch.cuda.Stream],
          wait_free: Callable[[int], float], used: list[torch.cuda.Stream], *,
          events: dict[torch.device, torch.cuda.Event], here: bool = False) -> float:
    """Copy one source into its range of ``data`` (a CUDA one queued on its device's side stream, which the
    caller synchronizes: ``used``); the seconds spent in ``wait_free``. ``here``: on a background thread, a
    host source is copied by that thread alone (:func:`hostmem.copy_here`)."""
    waited = wait_free(base + c.end)
    dst = data[base + c.begin : base + c.end]
    src = c.source
    if isinstance(src, bytes):
        ctypes.memmove(dst.data_ptr(), src, len(src))
        return waited
    if c.dtype != torch.uint8:
        dst = dst.view(c.dtype)
    dst = dst.view(c.shape)
    if not src.is_cuda:
        if here:
            hostmem.copy_here(dst, src)
        else:
            dst.copy_(src)
        return waited
    stream = streams.get(src.device)
    if stream is None:
        stream = streams[src.device] = torch.cuda.Stream(device=src.device)
    if stream not in used:
        if src.device in events:  # deferred: wait for the moment of save(), not for whatever runs now
            stream.wait_event(events[src.device])
        else:
            stream.wait_stream(torch.cuda.current_stream(src.device))
        used.append(stream)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    return waited


@dataclass(frozen=True)
class Staged:
    """A shard copied into a staging buffer: the buffer, and what the copy cost the caller."""

    buf: StagingBuffer
    wait_s: float  # waiting for a buffer, or for the previous write to pass the bytes overwritten
    staging_s: float  # copying
    done_at: float  # time.perf_counter() when the bytes were there (but the deferred ones)
    later: Callable[[], float] | None = None  # makes the deferred copies (a background thread calls it)


def stage_into(pool: StagingPool, plan: ShardPlan, streams: dict[torch.device, torch.cuda.Stream],
               defer: Callable[[EntryCopy], bool] | None = None, *, claim: bool = True,
               skip: Callable[[EntryCopy], bool] | None = None) -> Staged:
    """Take a buffer from ``pool`` (waiting if all are busy; ``claim``: or one being written) and copy ``plan``
    into it (but the copies ``defer`` picks: :attr:`Staged.later` makes those).

    On any failure the buffer goes back to the pool before the exception propagates.
    """
    buf, waited = pool.acquire(plan.file_bytes, claim=claim)
    try:
        t1 = time.perf_counter()
        behind, later = stage(plan, buf, streams, lambda end: pool.wait_free(buf, end), defer=defer, skip=skip)
        done = time.perf_counter()
    except BaseException:
        pool.abandon(buf)
        raise
    return Staged(buf=buf, wait_s=waited + behind, staging_s=done - t1 - behind, done_at=done, later=later)
