"""The copy of a state into a staging buffer (:mod:`persist_core.staging.pool`'s pool hands out the buffers).

:func:`stage_into` takes a buffer and calls :func:`stage`: the plan's header, then each source in file order, each
range once the writer of the buffer's previous shard is past it. CUDA sources go ``non_blocking`` on a per-device side
stream. A guarded save defers some copies (a background thread makes them while training goes on, each checked against
its version counter at ``save()``); an incremental save skips its unchanged tensors.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from persist_core import hostmem
from persist_core.errors import PersistError
from persist_core.planning.save import EntryCopy, ShardPlan
from persist_core.staging.pool import StagingBuffer, StagingPool


def stage(plan: ShardPlan, buf: StagingBuffer, streams: dict[torch.device, torch.cuda.Stream],
          wait_free: Callable[[int], float] = lambda end: 0.0,
          defer: Callable[[EntryCopy], bool] | None = None,
          skip: Callable[[EntryCopy], bool] | None = None) -> tuple[float, Callable[..., float] | None]:
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
        returns its own seconds spent in ``wait_free``, and takes an optional ``progress(end)``: called as the
        bytes ``[0, end)`` of ``buf`` become final (a memory snapshot's checksums follow the copy).
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
    return waited, lambda progress=None: _copy_all(later, data, base, streams, wait_free, events=events,
                                                   versions=versions, progress=progress)


def _version(source: torch.Tensor | bytes) -> int | None:
    """The tensor's version counter (autograd's: every in-place op bumps it), or ``None``."""
    return getattr(source, "_version", None) if isinstance(source, torch.Tensor) else None


def _copy_all(copies: list[EntryCopy], data: torch.Tensor, base: int, streams: dict[torch.device, torch.cuda.Stream],
              wait_free: Callable[[int], float], *, events: dict[torch.device, torch.cuda.Event],
              versions: list[int | None] | None = None, progress: Callable[[int], None] | None = None) -> float:
    """Copy each of ``copies`` into ``data`` (CUDA ones on side streams, waited for); seconds in ``wait_free``.
    ``progress(end)``: after each host copy while no device copy is pending, the bytes before ``end`` are final (those
    between the copies were staged before); it is not told the end (the caller knows when this returns).

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
        if progress is not None and not used:
            progress(base + c.end)
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
    later: Callable[..., float] | None = None  # makes the deferred copies (a background thread calls it; progress=)


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
