"""The memory tier's save side (issue 42): which steps it snapshots, and each snapshot's commit record.

A snapshot is a staged shard image in a slot of the staging pool (buffers mapped from files in shared memory,
:class:`~persist_core.memory.slots.SlotAllocator`): the copy a disk save makes anyway, so a step that also goes
to disk costs nothing more. Who calls what: ``save()`` and the memory-only ``snapshot()`` (training thread, the
:class:`~persist_core.save.saver.Saver`) call :meth:`Snapshots.taken` once a slot holds a step's bytes; before the
pool overwrites a slot, its allocator drops the slot's record (:meth:`SlotAllocator.reusing
<persist_core.memory.slots.SlotAllocator.reusing>`). On a thread of its own,
:meth:`Snapshots._commit` checksums the slot and writes its record, then lets the previous snapshot's slot go: the
newest committed snapshot's slot is kept (the pool hands it to no save) until a newer one is committed; with partner
copies (several nodes), so is the slot of each copy step until a newer one is settled (:meth:`Snapshots.copy_at`,
:meth:`Snapshots.settle`, as the :class:`~persist_core.memory.partner.CopySteps` answer; :mod:`persist_core.memory.partner`
says why). Behind a guard
the checksums hold off while an update runs (the overlap's :class:`~persist_core.turn.Turn`), as the disk writes do,
and they follow the copy thread block by block (:class:`Filling`) instead of starting once it is done.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import crc32c

from persist_core.fileio import CHECKSUM_ALGORITHM, checksum_block
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.lineage import snapshot_lineage
from persist_core.memory.partner import NO_COPY_STEPS, CopySteps
from persist_core.memory.slots import SlotAllocator
from persist_core.memory.option import MemoryTier
from persist_core.memory.store import MemoryStore, Snapshot
from persist_core.staging.filling import Filling
from persist_core.staging.pool import StagingBuffer, StagingPool
from persist_core.turn import NO_TURN, Turn

log = logging.getLogger(__name__)


class Snapshots:
    """One engine's snapshots in memory.

    Args:
        tier: what the user configured (``every_n_steps``, ``memory_dir``).
        store: this rank's snapshots on it.
        allocator: the pool's allocator (its buffers' files are the slots).
        pool: the staging buffers (made from ``allocator``): a committed snapshot's slot is kept there.
        copy_steps: the partner copies (several nodes; :data:`~persist_core.memory.partner.NO_COPY_STEPS`: none).
        turn: the overlap's: a guarded update holds the checksums off.
        chunk_bytes: the engine's write size (the checksum blocks are the disk's).
        rank: this process's rank (its file entry).
    """

    def __init__(self, tier: MemoryTier, store: MemoryStore, allocator: SlotAllocator, pool: StagingPool, *,
                 copy_steps: CopySteps = NO_COPY_STEPS, turn: Turn = NO_TURN, chunk_bytes: int, rank: int) -> None:
        self.tier, self.store, self.allocator, self.pool = tier, store, allocator, pool
        self._copies = copy_steps
        self._block = checksum_block(chunk_bytes)
        self._rank = rank
        self._lock = threading.Lock()
        self._newest: StagingBuffer | None = None  # the newest committed snapshot's slot (kept)
        self._newest_step = -1
        self._committed = 0
        self._no_room_said = False  # a snapshot found its file system full: said once for the run, DEBUG after
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="persist-memory")
        self._last: Future[None] | None = None  # the last commit submitted
        self._taken_max = -1  # the newest step saved or snapshot by this engine
        self._others_gone = False  # an earlier process's slots were removed (at the first commit)
        # partner copies: the copy step assigned (copy_at), the newest one handed over (offered with its snapshot,
        # or skipped when it has none), and the slots kept for copy steps, by step
        self._copy_step = self._handed = -1
        self._copy_slots: dict[int, StagingBuffer] = {}
        self.turn = turn

    @property
    def active(self) -> bool:
        """Snapshots are kept in memory (not given up for lack of room)."""
        return not self.allocator.full

    def branch(self, step: int) -> None:
        """Training thread: a save or snapshot of ``step`` was allowed (the timeline's check): memory records of
        newer steps are a branch the run went back from (a resume from an older step, ``start_over``), dropped now,
        whatever this save does after (a guarded one records no snapshot). Costs a listing only when the step goes
        back, or while an earlier process's slots are still there."""
        if step < self._taken_max or not self._others_gone:
            self.store.drop_newer(step)
        self._taken_max = max(self._taken_max, step)

    def before(self, step: int, *, copies: bool = True) -> bool:
        """Training thread, at a snapshot step: with partner copies (``copies``: not for an explicit snapshot) every
        rank first agrees whether it is a copy step (:meth:`CopySteps.agree
        <persist_core.memory.partner.CopySteps.agree>`, a collective call at each such step; its answer also says
        which kept slots go back); whether this rank takes the snapshot (``False``: out of room, and a copy step then
        said to the partner as having none)."""
        if copies:
            agreed = self._copies.agree(step)
            if agreed.settled is not None:
                self.settle(agreed.settled)
            if agreed:
                self.copy_at(step)
        if self.active:
            return True
        self.hand_over_missed(step + 1)
        return False

    def copy_at(self, step: int) -> None:
        """Training thread, before the snapshot of ``step``: every rank agreed it is a copy step; once committed, its
        slot is kept and it is offered to the partner copies."""
        with self._lock:
            if step <= self._handed:  # the run went back to an older step: the copy steps started over
                self._handed = -1
            self._copy_step = step

    def hand_over_missed(self, before: int) -> None:
        """Training thread, once the snapshots before ``before`` are committed or failed: a copy step among them that
        reached no commit (its copy failed, the memory tier ran out of room, the snapshot raised) is said to the
        partner copies as having no snapshot, so that every rank can go on to the next copy step."""
        with self._lock:
            missed = self._copy_step if self._handed < self._copy_step < before else None
            if missed is not None:
                self._handed = missed
        if missed is not None:
            self._copies.skip(missed)

    def settle(self, settled: int) -> None:
        """Training thread (:meth:`before`, as the copy steps' answer says), as a new copy step starts: every rank
        completed ``settled``; the slots kept for other copy steps go back."""
        with self._lock:
            gone = [b for s, b in self._copy_slots.items() if s != settled]
            self._copy_slots = {s: b for s, b in self._copy_slots.items() if s == settled}
        for buf in gone:
            self.pool.unkeep(buf)

    def follow(self, buf: StagingBuffer, nbytes: int) -> Filling | None:
        """Training thread, before a guarded snapshot's deferred copies: its checksums are computed on this thread
        of the snapshots as the copy thread fills ``buf`` (:meth:`Filling.reached`), so they end with the copy
        instead of after it (on two cores they ran into the next update, and the next snapshot waited for them).
        ``None``: not a slot of the memory tier. The copy thread must call :meth:`Filling.finish`."""
        if self.allocator.path_of(buf.tensor) is None:
            return None
        filling = Filling()
        filling.sums = self._thread.submit(self._checksums, buf, nbytes, filling)
        return filling

    def taken(self, buf: StagingBuffer, base: Manifest, nbytes: int, filename: str,
              filling: Filling | None = None) -> None:
        """Training thread (a guarded one's copy thread): ``buf`` holds the shard image (``nbytes``, named
        ``filename``) of ``base``'s step; it is kept from here and committed in the background (``filling``: its
        checksums, computed as the copy went, from :meth:`follow`)."""
        path = self.allocator.path_of(buf.tensor)
        if path is None:  # a buffer from this process's memory: the memory tier ran out of room
            self.hand_over_missed(base.step + 1)
            return
        self.pool.keep(buf)
        self._last = self._thread.submit(self._commit, buf, path, base, nbytes, filename, filling)

    def _checksums(self, buf: StagingBuffer, nbytes: int, filling: Filling | None = None) -> list[int] | None:
        """A crc32c per block of ``buf``'s first ``nbytes``, each once the copy passed it (``filling``); ``None``: the
        copy failed."""
        view = buf.memoryview(nbytes)
        crc = []
        for o in range(0, nbytes, self._block):
            if filling is not None and not filling.passed(min(o + self._block, nbytes)):
                return None
            self.turn.wait()  # a guarded update has the cores: the checksums go on after it
            crc.append(crc32c.crc32c(view[o : o + self._block]))
        return crc

    def _commit(self, buf: StagingBuffer, path: Path, base: Manifest, nbytes: int, filename: str,
                filling: Filling | None = None) -> None:
        try:
            crc = self._checksums(buf, nbytes) if filling is None else filling.sums.result()
            if crc is None:
                raise RuntimeError("its copy did not finish")
            entry = FileEntry(name=filename, rank=self._rank, size=nbytes, checksum=CHECKSUM_ALGORITHM,
                              chunk_bytes=self._block, chunks=tuple(crc))
            # its lineage: a disk save's (staged for both), else the run's engine's (issue 55)
            lineage = base.lineage or snapshot_lineage(self.store.root.parent.name)
            manifest = dataclasses.replace(base, files=(entry,), lineage=lineage)
            self.store.commit(path, manifest)
            self.store.drop_newer(base.step)  # the run went back to an older step: the newer ones are a branch
        except BaseException as e:  # the previous snapshot stays the newest
            no_room = isinstance(e, OSError) and e.errno == errno.ENOSPC
            if no_room and self._no_room_said:
                log.debug("[rank=%d][step=%d] the memory snapshot was not committed: %s", self._rank, base.step, e)
            elif no_room:
                self._no_room_said = True
                log.warning("[rank=%d][step=%d] the memory snapshot was not committed: %s; its file system is full "
                            "(said once: the next snapshots try again, and the disk saves go on); give %s more room",
                            self._rank, base.step, e, self.store.root)
            else:
                log.warning("[rank=%d][step=%d] the memory snapshot was not committed: %s", self._rank, base.step, e)
            self.pool.unkeep(buf)
            self.hand_over_missed(base.step + 1)
            return
        with self._lock:
            previous, self._newest = self._newest, buf
            self._newest_step = base.step
            self._committed += 1
            first = self._committed == 1
            copy = base.step == self._copy_step > self._handed
            if copy:  # a copy step: its slot stays until a newer one is settled
                self._handed = base.step
                self._copy_slots[base.step] = buf
                self.pool.keep(buf)
        if previous is not None:
            self.pool.unkeep(previous)
        if first:  # a restart read what it needed by now: the killed process's slots go
            self.store.remove_other_lives()
            self._others_gone = True
        log.debug("[rank=%d][step=%d] memory snapshot committed in %s", self._rank, base.step, path)
        if copy:
            self._copies.offer(Snapshot(manifest, path))

    def wait(self) -> None:
        """Until the snapshots taken so far are committed. A save calls it before it stages: the step before it
        is committed by then (at most one step is lost: the one whose record a kill interrupts), and the newest
        committed slot and the one to fill are all the memory tier needs beside the disk writes."""
        last = self._last
        if last is not None:
            last.result()

    @property
    def newest_step(self) -> int:
        """The newest committed snapshot's step (-1: none yet)."""
        with self._lock:
            return self._newest_step

    def close(self, *, finished: bool, disk_step: Callable[[], int] = lambda: -1) -> None:
        """Stop the commit thread; ``finished``: the run ended well, its snapshots go (a crash keeps them), and those
        of an earlier process once this engine committed a snapshot, or the disk a checkpoint of their step or later
        (``disk_step``: the newest committed there): a process that only read a killed run's snapshot leaves it."""
        self._thread.shutdown(wait=True)
        with self._lock:
            own = self._committed > 0
        self.store.close(remove=finished, others_up_to=None if own or not finished else disk_step())
