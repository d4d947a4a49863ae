"""The writer thread: staged shard -> file -> commit with the other ranks -> retention -> upload queue.

Who calls what, per checkpoint: ``save()`` (training thread) calls :meth:`Writer.reserve` for
its step, stages the state, then :meth:`Writer.submit`; the writer thread writes the shard in
parallel chunks (:mod:`persist_core.fileio`), commits it (:mod:`persist_core.save.commit`), calls
``after_commit`` (the :class:`Pipeline`: the hand-off to the upload queue, then local retention), and only
then ends the handle's local phase — in a ``finally``, so every escape ends it, reaches the
:class:`~persist_core.handle.ErrorLedger` and is raised once. The step stays *pending* (protected
from retention) until the upload queue has it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_core.save.commit import Nodes, commit_checkpoint, discover_nodes
from persist_core.distributed import Collectives
from persist_core.errors import PersistError, StepExistsError, WriteError
from persist_core.fileio import CHECKSUM_ALGORITHM, FileOps, write_file
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.handle import ErrorLedger, SaveHandle
from persist_core.layout import shard_filename
from persist_core.save.dedup import Incremental, Unstaged
from persist_core.save.digests import with_digests
from persist_core.staging.pool import StagingBuffer, StagingPool
from persist_core.tiers.local import checkpoint_dir
from persist_core.turn import NO_TURN, Turn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteJob:
    """One staged checkpoint for the writer: its handle, buffer, manifest so far and signature."""

    handle: SaveHandle
    buf: StagingBuffer
    base: Manifest
    staged_at: float  # time.perf_counter() when save() returned (a guarded save's background copy comes after)
    signature: str  # the state's structure, compared across ranks
    replace: bool = False  # a re-save of the committed step a run resumed from: exchanged atomically
    filename: str = ""  # the shard file's name (layout.shard_filename); default: this rank's .safetensors
    digests: tuple[int | None, ...] = ()  # of the tensors taken to be replicated, compared across ranks
    unstaged: Unstaged | None = None  # incremental: entries found unchanged before the copy (not in ``buf``)


#: ``after_commit(handle, manifest)``: writer thread, after the commit; may raise
AfterCommit = Callable[[SaveHandle, Manifest], None]


class Writer:
    """One writer thread, a pool of I/O threads, and the set of steps staged or being written.

    Args:
        root: ``local_dir``.
        pool: the staging buffers (the writer reports progress and releases them).
        coll: the job's collectives (the commit's).
        ops: the file system calls.
        ledger: where failures go.
        after_commit: called after each successful commit.
        write_threads / chunk_bytes / direct_io: see :class:`CheckpointEngine`.
        turn: whose turn the host is (:class:`~persist_core.turn.Turn`): the writes wait while a guarded update
            has it, and go in pieces while a guard is on.
    """

    def __init__(self, root: Path, *, pool: StagingPool, coll: Collectives, ops: FileOps, ledger: ErrorLedger,
                 after_commit: AfterCommit, write_threads: int, chunk_bytes: int, direct_io: str,
                 on_nodes: Callable[[Nodes], None] | None = None, turn: Turn = NO_TURN,
                 incremental: Incremental | None = None) -> None:
        self._root = root
        self.incremental = incremental  # the saver asks it, before a copy, what is unchanged
        self._turn = turn
        #: which ranks share local_dir: found out at the first save (one process: itself alone)
        self.nodes: Nodes | None = None if coll.world_size > 1 else discover_nodes(root, coll)
        self._on_nodes = on_nodes  # called once on the writer thread when the ranks turn out to be on several nodes
        self._pool = pool
        self._coll = coll
        self._ops = ops
        self._ledger = ledger
        self._after_commit = after_commit
        self._chunk_bytes = chunk_bytes
        self._direct_io = direct_io  # writer thread: "auto" settles on the first write
        self._lock = threading.Lock()
        self._pending: dict[int, SaveHandle | None] = {}  # None: reserved, not staged yet
        self._ours: set[int] = set()  # every step this engine reserved (its uploads are its own)
        self._io = ThreadPoolExecutor(write_threads, thread_name_prefix="persist-io")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="persist-writer")
        self.digest_s = 0.0  # seconds the writer thread spent on leaf digests, all told (the benchmark reads it)

    # ---- training thread

    def reserve(self, step: int, *, replace: bool = False) -> None:
        """Claim ``step`` for a save about to stage (``replace``: it may be committed already).

        Raises:
            StepExistsError: ``step`` is pending, or committed in ``local_dir`` and not ``replace``.
        """
        with self._lock:
            # pending: reserved (None) or a handle not yet ended; one that ended (its failure recorded) is on its
            # way out of the set, and a retry of its step may go on
            busy = step in self._pending and (self._pending[step] is None or not self._pending[step]._local.done())
            if busy or (not replace and checkpoint_dir(self._root, step).exists()):
                raise StepExistsError(
                    f"a checkpoint for step={step} already exists or is being written in {self._root}; "
                    f"save each step once (delete {checkpoint_dir(self._root, step)} first to overwrite it)"
                )
            self._pending[step] = None
            self._ours.add(step)

    def ours(self) -> set[int]:
        """Steps this engine reserved: committed by it, or on their way."""
        with self._lock:
            return set(self._ours)

    def unreserve(self, step: int) -> None:
        """Give ``step`` back: its staging failed."""
        with self._lock:
            self._pending.pop(step, None)
        if self.incremental is not None:
            self.incremental.forget(step)

    def submit(self, job: WriteJob) -> None:
        with self._lock:
            self._pending[job.handle.step] = job.handle
        self._thread.submit(self._run, job)
        job.handle._set_staged()

    def submit_after(self, job: WriteJob, copy: Callable[[], float]) -> None:
        """Copy thread (:class:`~persist_core.save.overlap.Overlap`): make a guarded save's deferred copies (``copy``
        returns its seconds spent waiting for the previous write to pass), then :meth:`submit` it. If they fail,
        the buffer and the step are given back and the failure goes to the ledger (raised once)."""
        handle = job.handle
        t0 = time.perf_counter()
        try:
            behind = copy()
        except BaseException as e:
            self._pool.abandon(job.buf)
            self.unreserve(handle.step)
            self._ledger.fail(handle, e)
            handle._set_staged()
            return
        handle._update(staging_s=handle.stats.staging_s + (time.perf_counter() - t0 - behind),
                       wait_s=handle.stats.wait_s + behind)
        self.submit(job)  # its commit_s counts from save() returning: the background copy included

    def pending_steps(self) -> set[int]:
        """Steps staged or being written (or handed to the upload queue just now)."""
        with self._lock:
            return set(self._pending)

    def in_flight(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def drain(self, deadline: float | None) -> None:
        """Block until nothing is pending; ``TimeoutError`` after ``deadline`` (``time.monotonic()``)."""
        while True:
            with self._lock:
                pending = [h for h in self._pending.values() if h is not None]
            if not pending:
                return
            for handle in pending:
                handle._wait_for(handle._local, None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self.incremental is not None:
            self.incremental.close()

    # ---- writer thread

    def _run(self, job: WriteJob) -> None:
        handle, step = job.handle, job.handle.step
        error: BaseException | None = None
        try:
            manifest = self._commit(job)
        except BaseException as e:  # recorded on the handle and raised once by a later call
            error = self._describe(e, step)
        else:
            try:
                self._after_commit(handle, manifest)
            except BaseException as e:
                error = PersistError(f"checkpoint step={step} was committed, but what follows the commit failed: "
                                     f"{type(e).__name__}: {e}")
                error.__cause__ = e
        finally:
            # the handle ends (its failure in the ledger) before it leaves the pending set: a drain that finds
            # nothing pending finds the failure (else a close removed the memory snapshots of a failed save)
            if error is None:
                handle._set_local_done()
            else:
                log.error("[rank=%d][step=%d] %s", self._coll.rank, step, error)
                self._ledger.fail(handle, error)
            with self._lock:
                if self._pending.get(step) is handle:  # not a new save of the same step, reserved since
                    del self._pending[step]

    def _commit(self, job: WriteJob) -> Manifest:
        """Write the staged shard and commit it with the other ranks; returns the manifest committed."""
        handle, buf = job.handle, job.buf
        timing: dict[str, Any] = {}
        settled = self._direct_io != "auto"

        side: memoryview | None = None  # an incremental shard made outside the slot (the memory tier's)

        def write_shard(tmp: Path) -> FileEntry:
            t0 = time.perf_counter()
            follow = settled and side is None
            if follow:  # the next save may copy into what is written already
                self._pool.writing(buf)
            on_chunk = (lambda offset, n: self._pool.chunk_written(buf, offset, n)) if follow else None
            name = job.filename or shard_filename(self._coll.rank)
            data = buf.memoryview(handle.stats.nbytes) if side is None else side
            written = write_file(tmp / name, data, pool=self._io,
                                 chunk_bytes=self._chunk_bytes, direct_io=self._direct_io, ops=self._ops,
                                 on_chunk=on_chunk, turn=self._turn.wait,
                                 piece_bytes=self._turn.piece_bytes())
            if not settled:  # "auto" found out what this file system takes; keep to it
                self._direct_io = "on" if written.direct_io else "off"
            timing.update(write_s=time.perf_counter() - t0, direct_io=written.direct_io)
            return FileEntry(name=written.name, rank=self._coll.rank, size=written.size, checksum=CHECKSUM_ALGORITHM,
                             chunk_bytes=written.chunk_bytes, chunks=written.chunks)

        if self.nodes is None:
            try:  # the first save: which ranks share local_dir (a collective call, in save order on every rank)
                self.nodes = discover_nodes(self._root, self._coll)
            except BaseException:
                self._pool.release(buf)
                raise
            if not self.nodes.shared:
                log.info("[rank=%d] local_dir %s is node %d of %d (ranks %s); each node commits its own ranks' "
                         "files", self._coll.rank, self._root, self.nodes.mine, len(self.nodes.groups),
                         list(self.nodes.groups[self.nodes.mine]))
                if self._on_nodes is not None:
                    self._on_nodes(self.nodes)
                if self.incremental is not None:
                    log.warning("[rank=%d] incremental=True: each node has a local_dir of its own, so every save is "
                                "written whole (a reference to another node's file could not be read on this one)",
                                self._coll.rank)
        try:  # resume verification's baseline: each plain tensor's digest, from the staged bytes (before compaction)
            t0 = time.perf_counter()
            base = with_digests(job.base, buf.memoryview(handle.stats.nbytes), turn=self._turn.wait,
                                known=None if job.unstaged is None else job.unstaged.hashes)
            self.digest_s += time.perf_counter() - t0
        except BaseException:
            self._pool.release(buf)
            if self.incremental is not None:
                self.incremental.forget(handle.step)
            raise
        incremental = self.incremental if self.nodes.shared else None  # each node its own disk: written whole
        if job.unstaged is not None and incremental is None:  # never reached (the saver asks first): never written
            self._pool.release(buf)
            raise PersistError(f"step {handle.step}: tensors left out of the copy cannot be written whole")
        if incremental is not None:
            try:  # what did not change is referenced; the buffer then holds only the rest
                base, nbytes, side = incremental.prepare(base, buf, handle.stats.nbytes, pool=self._io,
                                                         turn=self._turn.wait, unstaged=job.unstaged)
            except BaseException:
                self._pool.release(buf)
                incremental.settle(None)
                incremental.forget(handle.step)
                raise
            handle._update(nbytes=nbytes)
        try:
            manifest = commit_checkpoint(self._root, base, job.signature, digests=list(job.digests), coll=self._coll,
                                         write_shard=write_shard,
                                         release=lambda: self._pool.release(buf), ops=self._ops, replace=job.replace,
                                         nodes=self.nodes)
        except BaseException:
            if self.incremental is not None:
                self.incremental.settle(None)
                self.incremental.forget(handle.step)
            raise
        if self.incremental is not None:
            self.incremental.settle(manifest)
        write_s = timing["write_s"]
        handle._update(write_s=write_s, write_gbps=handle.stats.nbytes / write_s / 1e9 if write_s > 0 else None,
                       commit_s=time.perf_counter() - job.staged_at, direct_io=timing["direct_io"])
        log.info("[rank=%d][step=%d] committed %s (%.1f MB, %.2f GB/s)", self._coll.rank, handle.step,
                 checkpoint_dir(self._root, handle.step), handle.stats.nbytes / 1e6, handle.stats.write_gbps or 0.0)
        return manifest

    def _describe(self, e: BaseException, step: int) -> BaseException:
        if isinstance(e, PersistError) or not isinstance(e, OSError):
            return e
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space in {self._root} or keep fewer checkpoints"
        else:
            fix = f"check that {self._root} is a healthy, writable local file system"
        error = WriteError(e.errno or errno.EIO,
                           f"writing checkpoint step={step} in {self._root} failed: {e.strerror or e}; {fix}. "
                           "Nothing was committed for this step; earlier checkpoints are intact")
        error.__cause__ = e
        return error
