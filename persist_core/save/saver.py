"""The caller's thread of a save: check, plan (:mod:`persist_core.planning`), copy into a staging buffer
(:mod:`persist_core.staging.stage`), hand to the writer thread (:mod:`persist_core.save.writer`) — or, behind a
guard, to the overlap's copy thread (:mod:`persist_core.save.overlap`) — and return a handle."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from persist_core import _knobs
from persist_core.distributed import Collectives
from persist_core.format.manifest import Manifest
from persist_core.handle import ErrorLedger, SaveHandle, SaveStats
from persist_core.history import SaveHistory
from persist_core.planning.save import PlanCache, plan_rank
from persist_core.save.overlap import Overlap
from persist_core.save.dedup import Unstaged
from persist_core.staging.filling import Filling, followed
from persist_core.staging.pool import StagingBuffer, StagingPool
from persist_core.staging.stage import Staged, stage_into
from persist_core.save.writer import WriteJob, Writer

log = logging.getLogger(__name__)


class SnapshotSide(Protocol):
    """What a save asks of the memory tier's save side (:class:`~persist_core.memory.snapshots.Snapshots`; the save
    flow knows it by this protocol only), on the training thread in this order: 1. :meth:`branch` once the step is
    allowed; 2. :meth:`wait` before staging (the previous snapshot committed); 3. a memory-only snapshot:
    :meth:`hand_over_missed`; 4. a guarded one: :meth:`follow` before its deferred copy; 5. :meth:`taken` once the
    slot holds the step's bytes (a guarded one's copy thread)."""

    def branch(self, step: int) -> None: ...

    def wait(self) -> None: ...

    def hand_over_missed(self, before: int) -> None: ...

    def follow(self, buf: StagingBuffer, nbytes: int) -> Filling | None: ...

    def taken(self, buf: StagingBuffer, base: Manifest, nbytes: int, filename: str,
              filling: Filling | None = None) -> None: ...


class Saver:
    """``CheckpointEngine.save`` on the caller's thread.

    Args:
        coll: this process's collectives.
        pool: the staging buffers.
        writer: the writer thread.
        overlap: the guarded saves' background copy.
        history: what each save cost (the decisions read it).
        ledger: background failures, raised once.
        wall_clock: the time manifests record.
        torch_loadable / replica_check: see :class:`~persist_core.config.Config`.
        check_step: ``(step, resumed_at)``: raises for a step this run may not save (the timeline's refusals).
        check_backlog: ``(step, nbytes)``: raises when the bytes not yet uploaded would pass their limit.
        snapshots: the memory tier's save side, or ``None``: each staged step is also a snapshot in memory.
    """

    def __init__(self, *, coll: Collectives, pool: StagingPool, writer: Writer, overlap: Overlap,
                 history: SaveHistory, ledger: ErrorLedger, wall_clock: Callable[[], float], torch_loadable: bool,
                 replica_check: str, check_step: Callable[[int, int | None], None],
                 check_backlog: Callable[[int, int], None], snapshots: SnapshotSide | None = None) -> None:
        self._coll, self._pool, self._writer, self._overlap = coll, pool, writer, overlap
        self._history, self._ledger, self._wall_clock = history, ledger, wall_clock
        self._torch_loadable, self._replica_check = torch_loadable, replica_check
        self._check_step, self._check_backlog = check_step, check_backlog
        self._snapshots = snapshots
        self._plans = PlanCache()  # the same structure every save: laid out once
        self._snapshot_plans = PlanCache()  # several ranks: a snapshot is the rank's whole state, laid out apart
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.latest_step = -1  # the newest step saved (the upload lag counts from it)

    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None, resumed_at: int | None,
             lineage: dict[str, Any] | None = None) -> SaveHandle:
        """Stage ``state`` as ``step`` and hand it on (``lineage``: recorded in its manifest); see
        :meth:`CheckpointEngine.save`."""
        t0, decided_at = time.perf_counter(), self._history.now()
        step = self._begin(step, metadata, resumed_at)
        replace = step == resumed_at  # the step resumed from, saved again (Lightning does, with accumulation)
        if self._snapshots is not None:
            self._snapshots.wait()  # the previous snapshot is committed before this one may take a slot
        self._writer.reserve(step, replace=replace)
        try:
            plan = plan_rank(state, rank=self._coll.rank, world_size=self._coll.world_size,
                             torch_loadable=self._torch_loadable, replica_check=self._replica_check, seed=step,
                             cache=self._plans)
            self._check_backlog(step, plan.shard.file_bytes)
            base = plan.manifest(step=step, time=self._wall_clock(), metadata=metadata)
            if lineage is not None:
                base = dataclasses.replace(base, lineage=lineage)
            unstaged = self._unchanged(base, plan.shard.copies, step)
            staged = stage_into(self._pool, plan.shard, self._streams, defer=self._overlap.deferral(),
                                skip=None if unstaged is None else unstaged.skips)
        except BaseException:
            self._writer.unreserve(step)
            raise
        handle = SaveHandle(SaveStats(step=step, nbytes=plan.shard.file_bytes, wait_s=staged.wait_s,
                                      staging_s=staged.staging_s,
                                      unchanged_bytes=0 if unstaged is None else unstaged.nbytes))
        self.latest_step = max(self.latest_step, step)
        self._history.add(decided_at, step, handle)
        job = WriteJob(handle=handle, buf=staged.buf, base=base, staged_at=staged.done_at, signature=plan.signature,
                       replace=replace, filename=plan.filename, digests=tuple(plan.digests), unstaged=unstaged)
        plan_bytes = plan.shard.file_bytes
        del plan  # the writer needs only the staged bytes (and the deferred copy its sources), not the tensors
        handle._update(stall_s=time.perf_counter() - t0)
        # training goes on from here: a guarded save's background copy is part of what slows it (and of D)
        self._history.meter.staged(step, self._history.now())
        keep, filling = None, None  # one process: the staged shard is also the step's memory snapshot (kept before
        if self.disk_is_snapshot and self._snapshots is not None:  # the writer may release the buffer)
            snapshots = self._snapshots
            if staged.later is not None:  # guarded: its checksums follow the copy
                filling = snapshots.follow(staged.buf, plan_bytes)
            keep = lambda: snapshots.taken(staged.buf, base, plan_bytes, job.filename, filling)  # noqa: E731
        if staged.later is None:
            if keep is not None:
                keep()
            self._writer.submit(job)
        else:  # guarded: the snapshot is kept once its deferred copies are made
            self._on_copy_thread(handle, lambda: self._writer.submit_after(job, _then(staged.later, keep, filling)),
                                 filling)
        log.debug("[rank=%d][step=%d] staged %d bytes in %.3f s", self._coll.rank, step, handle.stats.nbytes,
                  handle.stats.staging_s)
        return handle

    def _begin(self, step: int, metadata: dict[str, Any] | None, resumed_at: int | None) -> int:
        """The prologue a save and a snapshot share, before either plans or stages: the previous guarded copy handed
        on (saves stay in order), a background failure raised once, the step and metadata checked, the run's
        timeline asked (a step past an older one resumed from starts the branch; with several ranks, a collective
        call the first time), then the memory tier told (its records of newer steps are the branch gone back from).
        The step, checked."""
        self._overlap.fence()
        self._ledger.raise_first()
        step = _knobs.check_step(step)
        _knobs.check_metadata(metadata)
        self._check_step(step, resumed_at)
        if self._snapshots is not None:
            self._snapshots.branch(step)
        return step

    def _unchanged(self, base: Manifest, copies: list, step: int) -> Unstaged | None:
        """Incremental, one process: the host tensors the newest committed checkpoint holds, hashed where they lie and
        left out of the copy (:meth:`~persist_core.save.dedup.Incremental.before_copy`)."""
        incremental = self._writer.incremental
        nodes = self._writer.nodes
        if incremental is None or self._coll.world_size != 1 or nodes is None or not nodes.shared:
            return None
        in_flight = sum(1 for s in self._writer.pending_steps() if s < step)
        return incremental.before_copy(base.tensors, copies, step, in_flight=in_flight)

    @property
    def disk_is_snapshot(self) -> bool:
        """A disk save's staged shard is also a whole snapshot: one process. With several, each rank's shard holds
        about ``1/world_size`` of the replicated state, so a step saved to disk is snapshot apart."""
        return self._coll.world_size == 1

    def snapshot(self, state: Any, step: int, *, metadata: dict[str, Any] | None, resumed_at: int | None) -> None:
        """Stage ``state`` as ``step`` into a slot of the memory tier, and nothing more (no disk): the copy
        runs on the caller's thread; the slot's record is written in the background. With several ranks, each
        rank's snapshot is its whole state as one process would save it (a restart of this rank reads it alone,
        whatever the other ranks hold); a ``DTensor`` leaf, its whole local part (a snapshot of rank ``part``,
        loaded into sharded targets)."""
        assert self._snapshots is not None
        step = self._begin(step, metadata, resumed_at)
        one = self.disk_is_snapshot
        plan = plan_rank(state, rank=0, world_size=1, torch_loadable=self._torch_loadable and one,
                         replica_check=self._replica_check, seed=step,
                         cache=self._plans if one else self._snapshot_plans, split=False)
        self._snapshots.wait()  # the previous snapshot is committed before this one may take a slot
        self._snapshots.hand_over_missed(step)  # a copy step before it that reached no commit: said to the partner
        staged = stage_into(self._pool, plan.shard, self._streams, claim=False, defer=self._overlap.deferral())
        base, nbytes, filename = plan.manifest(step=step, time=self._wall_clock(), metadata=metadata), \
            plan.shard.file_bytes, plan.filename
        if not one and plan.shardings:  # its DTensor leaves' local parts: it loads into sharded targets only
            base = dataclasses.replace(base, part=self._coll.rank)
        del plan  # a guarded snapshot's deferred copy needs its sources only

        filling = None

        def keep() -> None:
            try:
                self._snapshots.taken(staged.buf, base, nbytes, filename, filling)  # type: ignore[union-attr]
            finally:
                self._pool.release(staged.buf)  # free again, but kept while it is a snapshot

        if staged.later is None:
            keep()
            return
        # guarded: the parameters and optimizer state are copied while the next step computes, checksummed behind
        filling = self._snapshots.follow(staged.buf, nbytes)
        self._on_copy_thread(None, lambda: self._snapshot_after(staged, keep, step, filling), filling)

    def allow(self, step: int, resumed_at: int | None) -> None:
        """The run's timeline check a snapshot of ``step`` makes, without the snapshot (a rank whose memory tier ran
        out of room, beside ranks that snapshot: with several ranks the check is a collective call)."""
        self._check_step(_knobs.check_step(step), resumed_at)

    def _on_copy_thread(self, handle: SaveHandle | None, fn: Callable[[], None], filling: Filling | None) -> None:
        """Hand ``fn`` (deferred copies, then what follows them) to the overlap's copy thread; if it cannot take
        it, ``filling``'s checksums are told the copy failed (they would wait for it forever)."""
        try:
            self._overlap.run(handle, fn)
        except BaseException:
            if filling is not None:
                filling.finish(False)
            raise

    def _snapshot_after(self, staged: Staged, keep: Callable[[], None], step: int, filling: Filling | None) -> None:
        """Copy thread: a guarded snapshot's deferred copies (``filling`` told how far they got), then the slot is
        kept. If they fail, the slot goes back and the newest committed snapshot stays the newest (said once per
        failure; the disk saves go on)."""
        assert staged.later is not None
        try:
            followed(staged.later, filling)
        except BaseException as e:
            self._pool.abandon(staged.buf)
            log.warning("[rank=%d][step=%d] the memory snapshot's copy failed: %s", self._coll.rank, step, e)
            return
        try:
            keep()
        except Exception as e:  # the fence that waits for this thread never raises: said here
            log.warning("[rank=%d][step=%d] the memory snapshot was not kept: %s", self._coll.rank, step, e)

    def warm(self, manifest: Manifest) -> None:
        """A load returned ``manifest``'s checkpoint: the next saves will be about as large, so the staging buffers
        are allocated and their pages faulted in now, in the background, instead of by the first save's copy
        (which the next update would wait for)."""
        sizes = [f.size for f in manifest.files if f.rank == self._coll.rank]
        if manifest.world_size != self._coll.world_size or not sizes:  # another world size: an even share
            sizes = [-(-sum(f.size for f in manifest.files) // self._coll.world_size)]
        self._pool.warm(max(sizes))


def _then(copy: Callable[..., float], after: Callable[[], None] | None,
          filling: Filling | None = None) -> Callable[[], float]:
    """``copy``, then ``after`` once it succeeded (a guarded save's snapshot is kept once its bytes are all there);
    ``filling`` is told how far the copy got, and how it ended."""
    if after is None:
        return copy

    def run() -> float:
        behind = followed(copy, filling)
        after()
        return behind
    return run
