"""The writer thread: staged shard -> file -> commit with the other ranks -> retention -> upload queue.

Who calls what, per checkpoint: ``save()`` (training thread) calls :meth:`Writer.reserve` for
its step, stages the state, then :meth:`Writer.submit`; the writer thread writes the shard in
parallel chunks (:mod:`persist_core.fileio`), commits it (:mod:`persist_core.commit`), calls
``after_commit`` (the :class:`Pipeline`: the hand-off to the upload queue, then local retention), and only
then ends the handle's local phase — in a ``finally``, so every escape ends it, reaches the
:class:`~persist_core.handle.ErrorLedger` and is raised once. The step stays *pending* (protected
from retention) until the upload queue has it.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_core._knobs import WriteSettings, remote_lease_s, run_id_from_env
from persist_core.assembly import Coordinator, Follower, uploads_channel
from persist_core.commit import Nodes, commit_checkpoint, discover_nodes
from persist_core.distributed import Collectives
from persist_core.errors import PersistError, RemoteError, StepExistsError, WriteError
from persist_core.fileio import CHECKSUM_ALGORITHM, FileOps, write_file
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.handle import ErrorLedger, SaveHandle, SaveStats
from persist_core.history import HistoryLog
from persist_core.layout import shard_filename
from persist_core.ownership import write_unsynced
from persist_core.policies.retention import RetentionPolicy
from persist_core.retainer import Retainer
from persist_core.staging import StagingBuffer, StagingPool
from persist_core.sync import RemoteSync, SyncJob
from persist_core.tiers.local import LocalTier, checkpoint_dir, discover
from persist_core.tiers.lease import RemoteLease, local_run_id
from persist_core.timeline import Timeline
from persist_core.tiers.remote import RemoteTier

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
    """

    def __init__(self, root: Path, *, pool: StagingPool, coll: Collectives, ops: FileOps, ledger: ErrorLedger,
                 after_commit: AfterCommit, write_threads: int, chunk_bytes: int, direct_io: str,
                 on_nodes: Callable[[Nodes], None] | None = None, turn: Callable[[], None] | None = None) -> None:
        self._root = root
        self._turn = turn or (lambda: None)  # blocks while a guarded update has the host (overlap.Turn.wait)
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

    # ---- training thread

    def reserve(self, step: int, *, replace: bool = False) -> None:
        """Claim ``step`` for a save about to stage (``replace``: it may be committed already).

        Raises:
            StepExistsError: ``step`` is pending, or committed in ``local_dir`` and not ``replace``.
        """
        with self._lock:
            if step in self._pending or (not replace and checkpoint_dir(self._root, step).exists()):
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

    def submit(self, job: WriteJob) -> None:
        with self._lock:
            self._pending[job.handle.step] = job.handle
        self._thread.submit(self._run, job)

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
            with self._lock:
                self._pending.pop(step, None)
            if error is None:
                handle._set_local_done()
            else:
                log.error("[rank=%d][step=%d] %s", self._coll.rank, step, error)
                self._ledger.fail(handle, error)

    def _commit(self, job: WriteJob) -> Manifest:
        """Write the staged shard and commit it with the other ranks; returns the manifest committed."""
        handle, buf = job.handle, job.buf
        timing: dict[str, Any] = {}
        settled = self._direct_io != "auto"

        def write_shard(tmp: Path) -> FileEntry:
            t0 = time.perf_counter()
            if settled:  # the next save may copy into what is written already
                self._pool.writing(buf)
            on_chunk = (lambda offset, n: self._pool.chunk_written(buf, offset, n)) if settled else None
            name = job.filename or shard_filename(self._coll.rank)
            written = write_file(tmp / name, buf.memoryview(handle.stats.nbytes), pool=self._io,
                                 chunk_bytes=self._chunk_bytes, direct_io=self._direct_io, ops=self._ops,
                                 on_chunk=on_chunk, turn=self._turn)
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
        manifest = commit_checkpoint(self._root, job.base, job.signature, digests=list(job.digests), coll=self._coll,
                                     write_shard=write_shard,
                                     release=lambda: self._pool.release(buf), ops=self._ops, replace=job.replace,
                                     nodes=self.nodes)
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


class Pipeline:
    """What follows ``save()``, wired once: the writer, the upload queue, retention on both tiers.

    After each commit (writer thread) the checkpoint goes to the upload queue first, then local
    retention runs; after each upload (sync thread) both tiers' retention runs. Local retention
    never touches a step that is pending here or not yet uploaded (:meth:`protected`); only rank 0
    applies retention and uploads.

    Args:
        root: ``local_dir``.
        pool / coll / ops / ledger: as for :class:`Writer`.
        settings: the engine's write settings.
        tier: the remote tier, or ``None``.
        keep_local / keep_remote: the tiers' retention policies.
        latest_step: the newest step saved (for upload lag).
        remote_timeout_s / max_unsynced_bytes / run_id: see :class:`CheckpointEngine`.
    """

    def __init__(self, root: Path, *, pool: StagingPool, coll: Collectives, ops: FileOps, ledger: ErrorLedger,
                 settings: WriteSettings, tier: RemoteTier | None, keep_local: RetentionPolicy | None,
                 keep_remote: RetentionPolicy | None, latest_step: Callable[[], int], remote_timeout_s: float = 300.0,
                 max_unsynced_bytes: int | None = None, run_id: str | None = None,
                 turn: Callable[[], None] | None = None) -> None:
        self._root = root
        self._turn = turn or (lambda: None)
        self._remote_timeout_s = remote_timeout_s
        self._max_unsynced = max_unsynced_bytes
        self._gave_up = False  # the last drain gave up on the remote
        self.closing = False  # set by close(): a drain right after giving up waits no second remote_timeout_s
        leader = coll.rank == 0
        self._coll = coll
        self._tier = tier
        self.follower: Follower | None = None  # every other rank's part in the upload rounds (several nodes)
        self.history = HistoryLog(root)  # what each save cost, for persist stats (rank 0 writes it)
        self.writer = Writer(root, pool=pool, coll=coll, ops=ops, ledger=ledger, after_commit=self._after_commit,
                             write_threads=settings.write_threads, chunk_bytes=settings.chunk_bytes,
                             direct_io=settings.direct_io, on_nodes=self._on_nodes, turn=turn)
        local = LocalTier(root)
        self.local = Retainer(local, keep_local, protected=self.protected)
        self._url = None if tier is None else tier.url  # before RemoteSync: its thread may upload a backlog at once
        self._record_lock = threading.Lock()
        self.sync = None if tier is None or not leader else RemoteSync(
            tier, keep_remote=keep_remote, ledger=ledger, backlog=self._backlog, after_upload=self._after_upload,
            latest_step=latest_step, lease=RemoteLease(tier, run_id or run_id_from_env() or local_run_id(root),
                                                       ttl_s=remote_lease_s()),
            abandoned=local.abandoned_manifests)
        self.timeline = Timeline(root, local, self.sync, leader=leader)
        if self.sync is not None:  # now that protected() and the record can see it
            self.sync.start()

    def adopt_remote_run(self) -> None:
        """This run resumed from a checkpoint downloaded from the remote: continue the run holding its lease."""
        if self.sync is not None:
            self.sync.adopt_lease(self._root)

    def _on_nodes(self, nodes: Nodes) -> None:
        """Writer thread, at the first save, when the ranks turn out to be on several nodes: the upload
        rounds that assemble each checkpoint's remote copy start."""
        if self._tier is None:
            log.warning("[rank=%d] local_dir is node-local (%d nodes) and there is no remote_url: each node holds "
                        "its own ranks' files only, so a restore that needs another node's bytes cannot find them; "
                        "pass remote_url", self._coll.rank, len(nodes.groups))
            return
        channel = uploads_channel(self._coll)
        if channel is None:
            log.error("[rank=%d] local_dir is node-local (%d nodes) but the collectives have no uploads channel "
                      "(build them with TorchCollectives.new_group()): these checkpoints cannot be uploaded",
                      self._coll.rank, len(nodes.groups))
            return
        if self.sync is not None:
            self.sync.set_peers(Coordinator(channel, self.sync.unsynced_steps))
        else:
            self.follower = Follower(self._root, channel, self._tier, after_round=self._after_round)

    def _node_leader(self) -> bool:
        """This rank looks after its node's directory: rank 0, and the first rank of each other node."""
        nodes = self.writer.nodes
        return self._coll.rank == 0 or (nodes is not None and not nodes.shared and nodes.leader)

    def _retain_local(self) -> None:
        """Local retention, where this rank applies it: rank 0, and the leader of each other node (the same
        policy over the same committed steps, keeping what rank 0 says is not uploaded: the same steps go)."""
        if self._node_leader():
            self._turn()  # deleting a checkpoint is kernel work on the cores a guarded update is using
            self.local.apply()

    def _after_round(self) -> None:
        """Follower thread, after each upload round: this node's record of what is not uploaded (for
        ``persist gc`` on this node's directory), then its retention."""
        if self._node_leader():
            self._record_unsynced()
            self.local.apply()

    def protected(self) -> set[int]:
        """Steps local retention must keep: pending here, or not uploaded yet (queued, uploading, failed).

        Until the remote has been listed once (a job restarted during an outage), nobody knows what it
        lacks: every local checkpoint is kept. On another node's leader: what rank 0 says is not uploaded.
        """
        pending = self.writer.pending_steps()  # first: a step leaves it only once the upload queue has it
        if self.follower is not None:
            return pending | self.follower.protected()
        if self.sync is None:
            if self._tier is not None and self._coll.rank != 0:  # several nodes, no upload rounds: keep all
                return pending | set(self.local.tier.committed_steps())
            return pending
        if not self.sync.listed:
            return pending | set(self.local.tier.committed_steps())
        return pending | self.sync.unsynced_steps()

    def _after_commit(self, handle: SaveHandle, manifest: Manifest) -> None:
        """Writer thread: hand the checkpoint to the upload queue first, then apply local retention."""
        if self._coll.rank == 0:
            self.history.record("committed", handle.stats, time=manifest.time)
        if self.sync is None:
            handle._set_remote_done()
            if self.follower is not None and self._node_leader():  # another node's directory: its own record
                self._record_unsynced()
        else:
            self.sync.submit(SyncJob(local_ckpt=checkpoint_dir(self._root, handle.step), manifest=manifest,
                                     handle=handle, committed_at=time.monotonic()))
            self._record_unsynced()
        self._retain_local()

    def _after_upload(self, job: SyncJob) -> None:
        """Sync thread, after each upload: the records first, then local retention (what waited may go)."""
        if job.handle.stats.lag_s is not None:  # this engine's own save (a backlog job's handle has no numbers)
            self.history.record("uploaded", job.handle.stats)
        self._record_unsynced()
        self._retain_local()

    def _record_unsynced(self) -> None:
        """Rewrite ``local_dir``'s record of what is not uploaded yet, for ``persist gc`` (best effort)."""
        assert self._url is not None
        with self._record_lock:
            try:
                write_unsynced(self._root, self._url, self.protected())
            except OSError as e:
                log.warning("could not record the un-synced steps in %s: %s", self._root, e)

    def _backlog(self, remote_steps: set[int]) -> list[SyncJob]:
        """Sync thread, at start-up: the committed local checkpoints the remote lacks (an earlier run's)."""
        ours = self.writer.ours()  # read first: a step it saves is reserved before it can be found committed
        return [SyncJob(local_ckpt=Path(info.path), manifest=manifest, committed_at=time.monotonic(),
                        handle=SaveHandle(SaveStats(step=info.step, nbytes=info.nbytes)))
                for info, manifest in discover(self._root)
                if info.step not in remote_steps and info.step not in ours]

    def prune(self) -> None:
        self._retain_local()
        if self.sync is not None:
            self.sync.apply_retention()

    def check_backlog(self, step: int, nbytes: int) -> None:
        """Refuse a save that would pile more un-synced bytes than the cap (an outage); nothing is deleted.

        Raises:
            WriteError: the cap (``max_unsynced_bytes``, else 10% of the disk left free) would be passed.
        """
        backlog = 0 if self.sync is None else self.sync.unsynced_bytes()
        if not backlog:
            return
        if self._max_unsynced is not None:
            full, limit = backlog + nbytes > self._max_unsynced, f"max_unsynced_bytes={self._max_unsynced}"
        else:
            disk = shutil.disk_usage(self._root)
            full, limit = disk.free - nbytes < 0.1 * disk.total, f"10% of {self._root}'s file system free"
        if full:
            raise WriteError(errno.ENOSPC, (
                f"checkpoint step={step} not saved: {backlog} bytes of checkpoints ({sorted(self.sync.unsynced_steps())}) "
                f"still wait for {self._url} (uploads failing: {self.sync.failures} attempts), and {nbytes} more would "
                f"pass {limit}. Nothing was deleted; restore the remote (or pass a larger max_unsynced_bytes) and "
                "save again"))

    def drain(self, timeout: float | None) -> None:
        """Block until nothing is pending or un-synced.

        Raises:
            TimeoutError: ``timeout`` ran out first.
            RemoteError: uploads still fail after ``remote_timeout_s``; names the un-synced steps
                (committed locally and protected there; the next engine uploads them).
        """
        remote_wait_s = min(0.5, self._remote_timeout_s) if self.closing and self._gave_up else self._remote_timeout_s
        try:
            self._drain(timeout, remote_wait_s)
        except RemoteError:
            self._gave_up = True
            raise
        self._gave_up = False

    def _drain(self, timeout: float | None, remote_wait_s: float) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.writer.drain(deadline)
        if self.sync is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        bounded = left is None or left > remote_wait_s
        if self.sync.drain(remote_wait_s if bounded else left):
            return
        if not bounded:
            raise TimeoutError(f"uploads to {self._url} still pending after {timeout} s")
        steps = sorted(self.sync.unsynced_steps())
        raise RemoteError(
            f"uploads to {self._url} did not complete within remote_timeout_s={self._remote_timeout_s:g}: un-synced steps "
            f"{steps} ({self.sync.failures} failed attempts so far). They stay committed in {self._root} and are "
            "never deleted before they are uploaded; a later wait(), or the next engine on this directory, uploads them")

    def close(self) -> None:
        self.writer.close()
        if self.sync is not None:  # after giving up on the remote, do not upload the queue at close
            self.sync.close(give_up=self._gave_up, give_up_after_s=max(5.0, self._remote_timeout_s))
            if self.sync.peers is not None and not self.sync.running:
                self.sync.peers.stop()  # the other ranks' upload rounds end
        if self.follower is not None:  # rank 0 says stop once its queue is done
            self.follower.close(timeout_s=max(60.0, 3 * self._remote_timeout_s))
