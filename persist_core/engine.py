"""``CheckpointEngine``: the one stateful coordinator of stage, write and commit.

Call order (one process):

* ``save(state, step)`` — caller's thread: flatten and plan, wait for a free staging buffer
  (back-pressure), copy into it, queue the write, return a :class:`SaveHandle`.
* writer thread — write the shard in parallel chunks, free the buffer, write the manifest
  last, rename into place (see :mod:`persist_core.local_writer`).
* ``wait()`` / ``close()`` — drain; a background failure is raised once.
* ``list()`` / ``load()`` — committed checkpoints only, verified.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import crc32c
import torch

from persist_core import _knobs
from persist_core.commit import commit_checkpoint
from persist_core.decisions import Clock, DecisionContext, PreemptionNotice, SavePolicy, check_save_policy
from persist_core.distributed import Collectives, SingleProcess, decision_channel
from persist_core.errors import (
    ConfigError,
    PersistError,
    StepExistsError,
    WriteError,
)
from persist_core.format import FlatState, assign_owners, dtype_name, flatten, plan_shard, storage_groups
from persist_core.handle import SaveHandle, SaveStats
from persist_core.history import SaveHistory
from persist_core.layout import parse_tmp_dirname, shard_filename
from persist_core.local_writer import (
    CHECKSUM_ALGORITHM,
    FileOps,
    OsFileOps,
    remove_checkpoint,
    write_file,
)
from persist_core.manifest import FileEntry, Manifest
from persist_core.preemption import check_grace, drain_within
from persist_core.reader import CheckpointReader
from persist_core.restore import CheckpointInfo, checkpoint_dir, discover
from persist_core._sync import RemoteSync, SyncJob
from persist_core.remote import RemoteTier
from persist_core.retention import RetentionContext, RetentionPolicy, check_policy, to_delete
from persist_core.staging import StagingBuffer, StagingPool, stage

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _Settings:
    write_threads: int
    chunk_bytes: int
    direct_io: str
    max_pending: int
    verify: bool

    def __post_init__(self) -> None:
        if self.write_threads < 1:
            raise ConfigError(f"write_threads={self.write_threads} must be at least 1")
        if self.chunk_bytes < _knobs.PAGE_BYTES or self.chunk_bytes % _knobs.PAGE_BYTES:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of {_knobs.PAGE_BYTES}")
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"direct_io={self.direct_io!r} must be 'auto', 'on' or 'off'")
        if self.max_pending < 1:
            raise ConfigError(
                f"max_pending={self.max_pending} must be at least 1 (each pending save holds one staging buffer)"
            )


def _structure_signature(flat: FlatState, groups: list[list[int]]) -> str:
    """A digest of the state's structure (paths, dtypes, shapes, shared storages) that ranks compare."""
    described = [[p, dtype_name(t.dtype), list(t.shape)] for p, t in flat.tensors]
    return f"{crc32c.crc32c(json.dumps([described, groups]).encode()):08x}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _close_at_exit(engine: CheckpointEngine) -> None:
    """Drain ``engine`` when the interpreter exits with it still open: pending writes commit and
    queued uploads finish, instead of dying with the thread pools (a weak reference, so an
    engine that is dropped is not kept alive). Runs before concurrent.futures stops its workers.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    ref = weakref.ref(engine)

    def close() -> None:
        live = ref()
        if live is not None and not live._closed:
            try:
                live.close()
            except PersistError as e:
                log.error("%s at exit: %s", live._prefix(), e)

    register(close)


class CheckpointEngine:
    """Asynchronous, verified checkpoints of a PyTorch state on a local directory.

    Example::

        with CheckpointEngine(local_dir="/nvme/ckpt") as engine:
            for step in range(1, 10_001):
                train_step()
                if step % 100 == 0:
                    engine.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
        state = CheckpointEngine(local_dir="/nvme/ckpt").load()   # the newest committed checkpoint

    Args:
        local_dir: directory of the local tier (created if missing); ideally on NVMe.
        write_threads: threads writing chunks of a shard in parallel (default 4, env
            ``PERSIST_WRITE_THREADS``).
        chunk_bytes: bytes per write and per checksum, a multiple of 4 KiB (default 32 MiB).
        direct_io: ``"auto"`` (``O_DIRECT`` where the file system takes it), ``"on"`` or ``"off"``.
        max_pending: checkpoints that may be staged or writing at once; each holds one staging
            buffer about the size of the state. With the default 1, a ``save`` while the previous
            write runs waits for it (``stats.wait_s``) instead of allocating a second copy.
        verify: check crc32c checksums on ``load`` (default True).
        remote_url: an fsspec URL (``s3://bucket/run-7``, ``gs://``, ``az://``, ``file://``,
            ``memory://``) every committed checkpoint is uploaded to in the background; ``load``
            falls back to it. ``None``: local only.
        storage_options: passed to fsspec as-is (``{"client_kwargs": {"endpoint_url": ...}}``).
        keep_local: retention policy for ``local_dir``, applied after each commit, e.g.
            ``KeepLastN(2)`` or ``AnyOf(KeepLastN(2), KeepEveryNSteps(1000))``; ``None`` keeps all.
            The newest committed checkpoint, and any not yet uploaded, are never deleted.
        keep_remote: retention policy for the remote tier, applied after each upload; queued
            uploads it would not keep may be superseded by newer ones when the remote is slow.
        collectives: for a job of several processes, their collectives
            (:class:`TorchCollectives`): every rank then calls ``save`` for the same steps in the
            same order and writes about ``1/world_size`` of a state they all hold alike; rank 0
            commits, applies retention and uploads. ``local_dir`` must be shared by the ranks.
            Single process by default.
        save_policy: when :meth:`maybe_save` saves (``Continuous(min_interval_s=30)``,
            ``EveryNSteps(1000)``, ``OptimalInterval(mtbf_s=...)``, ``AnyOf(...)``).
        preemption: a :class:`PreemptionNotice`; once set, the next ``maybe_save`` saves
            whatever the policy says, then waits up to ``preemption_grace_s`` for the commit and
            upload, and :attr:`preempted` tells the loop to stop.
        clock: the monotonic clock decisions use (a fake one in tests).
        file_ops: the file system calls the writer makes (for fault injection in tests).

    Raises:
        ConfigError: a bad argument, or ``local_dir`` cannot be created or written.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        write_threads: int | None = None,
        chunk_bytes: int | None = None,
        direct_io: str | None = None,
        max_pending: int = 1,
        verify: bool = True,
        remote_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_local: RetentionPolicy | None = None,
        keep_remote: RetentionPolicy | None = None,
        collectives: Collectives | None = None,
        save_policy: SavePolicy | None = None,
        preemption: PreemptionNotice | None = None,
        preemption_grace_s: float = 120.0,
        clock: Clock = time.monotonic,
        file_ops: FileOps | None = None,
    ) -> None:
        self._settings = _Settings(
            write_threads=_knobs.write_threads() if write_threads is None else write_threads,
            chunk_bytes=_knobs.chunk_bytes() if chunk_bytes is None else chunk_bytes,
            direct_io=_knobs.direct_io() if direct_io is None else direct_io,
            max_pending=max_pending,
            verify=verify,
        )
        self._keep_local = None if keep_local is None else check_policy(keep_local, name="keep_local")
        keep_remote = None if keep_remote is None else check_policy(keep_remote, name="keep_remote")
        if keep_remote is not None and remote_url is None:
            raise ConfigError("keep_remote was given without remote_url; pass remote_url='s3://...' or drop keep_remote")
        self._root = Path(local_dir).expanduser().absolute()
        self._direct_io = self._settings.direct_io  # writer thread: "auto" settles on the first write
        self._save_policy = None if save_policy is None else check_save_policy(save_policy)
        self._preemption = preemption
        self._grace_s = check_grace(preemption_grace_s)
        self._clock = clock
        self._history = SaveHistory(clock)
        self._preempt_saved = False
        self._coll = collectives or SingleProcess()
        self._leader = self._coll.rank == 0
        self._ops = file_ops or OsFileOps()
        self._open_dir()
        self._lock = threading.Lock()
        self._pending: dict[int, SaveHandle] = {}
        self._unreported: list[SaveHandle] = []
        self._pool = StagingPool(self._settings.max_pending, pin=torch.cuda.is_available())
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._io = ThreadPoolExecutor(self._settings.write_threads, thread_name_prefix="persist-io")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="persist-writer")
        self._retention_lock = threading.Lock()
        self._latest_step = -1
        self._closed = False
        self._tier = None if remote_url is None else RemoteTier(remote_url, storage_options)
        self._reader = CheckpointReader(self._root, verify=verify, tier=self._tier)
        self._sync = None
        self._syncing: dict[int, tuple[SaveHandle, float]] = {}
        if self._tier is not None and self._leader:
            self._sync = RemoteSync(self._tier, keep_remote=keep_remote, on_done=self._on_synced)
            self._resume_uploads()
        _close_at_exit(self)

    # ------------------------------------------------------------------ setup

    def _open_dir(self) -> None:
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            probe = self._root / f".probe-pid{os.getpid()}-{secrets.token_hex(3)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"local_dir={str(self._root)!r} is not a writable directory ({e.strerror or e}); "
                "pass a directory this process can create files in"
            ) from e
        for entry in os.scandir(self._root):
            parsed = parse_tmp_dirname(entry.name)
            if parsed is not None and not _pid_alive(parsed[1]):
                log.info("%s removing %s left by a crashed run", self._prefix(parsed[0]), entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)

    def _prefix(self, step: int | None = None) -> str:
        return f"[rank={self._coll.rank}][step={step if step is not None else '-'}]"

    # ------------------------------------------------------------------ save

    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Snapshot ``state`` and write it in the background; returns once it is staged.

        After this returns the caller may mutate anything in ``state``.

        Args:
            state: nested dicts / lists / tuples of tensors (any device) and picklable values.
            step: the training step, a non-negative int not saved before in ``local_dir``.
            metadata: JSON-able values stored in the manifest.

        Returns:
            A handle to wait on; its ``stats`` tell the stall and the write speed.

        Raises:
            ConfigError: a bad step. StepExistsError: ``step`` is already committed or pending.
            UnsupportedStateError: a leaf of ``state`` cannot be saved (its key path is named).
            PersistError: an earlier save failed in the background (raised once).
        """
        t0 = time.perf_counter()
        t_decided = self._clock()
        self._check_open()
        self._raise_unreported()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int (the training step)")
        with self._lock:
            if step in self._pending or checkpoint_dir(self._root, step).exists():
                raise StepExistsError(
                    f"a checkpoint for step={step} already exists or is being written in {self._root}; "
                    f"save each step once (delete {checkpoint_dir(self._root, step)} first to overwrite it)"
                )
        flat = flatten(state)
        groups = storage_groups(flat)
        owners = assign_owners(flat, groups, self._coll.world_size) if self._coll.world_size > 1 else None
        plan = plan_shard(flat, groups=groups, owners=owners, rank=self._coll.rank)
        signature = _structure_signature(flat, groups) if owners is not None else ""
        buf, waited = self._pool.acquire(plan.file_bytes)
        try:
            t1 = time.perf_counter()
            behind = stage(plan, buf, self._streams, lambda end: self._pool.wait_free(buf, end))
            staged = time.perf_counter()
        except BaseException:
            self._pool.abandon(buf)
            raise
        waited += behind  # copying behind the previous write: the part spent waiting for it
        shard = shard_filename(self._coll.rank)
        records = tuple(None if r is None else {"file": shard, **r, "replicated": True} for r in plan.records)
        objects = tuple((shard, b, n) for b, n in plan.objects)
        handle = SaveHandle(
            SaveStats(step=step, nbytes=plan.file_bytes, wait_s=waited, staging_s=staged - t1 - behind,
                      stall_s=staged - t0)
        )
        with self._lock:
            self._pending[step] = handle
            self._latest_step = max(self._latest_step, step)
        self._history.add(t_decided, step, handle)
        base = Manifest(step=step, time=time.time(), world_size=1, tree=flat.tree, tensors=records, objects=objects,
                        files=(), metadata=dict(metadata or {}))
        del plan, flat  # the writer needs only the staged bytes, not the caller's tensors
        handle._update(stall_s=time.perf_counter() - t0)
        self._writer.submit(self._write_and_commit, handle, buf, base, staged, signature)
        self._history.meter.staged(step, self._clock())
        log.debug("%s staged %d bytes in %.3f s", self._prefix(step), handle.stats.nbytes, handle.stats.staging_s)
        return handle

    def maybe_save(self, make_state: Callable[[], Any], step: int, *,
                   metadata: dict[str, Any] | None = None) -> SaveHandle | None:
        """Save if the save policy — or a preemption notice — says so; builds the state only then.

        After a preemption notice, the first call saves ``step`` (unless it is saved already),
        waits up to ``preemption_grace_s`` for the commit and upload, and sets :attr:`preempted`.

        With several processes (``collectives``), every rank must call it at the same steps: rank
        0's policy decides for all, and a preemption notice on any rank counts for every rank, so
        all save the same step and none waits for a save the others skipped.

        Args:
            make_state: returns the state (called only when saving).
            step: this decision point's step.
            metadata: as for :meth:`save`.

        Returns:
            The save's handle, or ``None`` when it did not save.

        Raises:
            ConfigError: the engine has no ``save_policy``; the ranks passed different steps, or
                their collectives have no decision channel. Otherwise as :meth:`save`.
        """
        decided, preempting = self.decide(step)
        handle = self.save(make_state(), step, metadata=metadata) if decided else None
        if preempting:
            self.finish_preemption()
        return handle

    def decide(self, step: int) -> tuple[bool, bool]:
        """``(save now, preempting)`` at ``step``, the same on every rank (a collective call then).

        Rank 0's policy decides; a preemption notice on any rank makes every rank save ``step``
        (unless saved already) and then :meth:`finish_preemption`. For adapters that build the
        state their own way; :meth:`maybe_save` is this plus the save.

        Raises:
            ConfigError: as for :meth:`maybe_save`.
        """
        preempting = self.preemption_pending()
        decided = self.should_save(step)
        if self._coll.world_size == 1:
            return decided, preempting
        channel = decision_channel(self._coll)
        if channel is None:
            raise ConfigError(
                f"maybe_save across {self._coll.world_size} processes needs collectives with a decision channel "
                f"({self._coll!r} has no 'decisions'); create them with TorchCollectives.new_group()")
        votes = channel.all_gather((step, decided, preempting))
        steps = [v[0] for v in votes]
        if len(set(steps)) > 1:
            raise ConfigError(f"maybe_save was called at different steps on the ranks ({steps}, by rank); "
                              "every rank must call it at the same decision points with the same step")
        if any(v[2] for v in votes):  # a notice on any rank: every rank saves this step unless it is saved
            return not self._known(step), True
        return votes[0][1], False

    def _known(self, step: int) -> bool:
        with self._lock:
            pending = step in self._pending
        return pending or self._history.last_step() == step

    def should_save(self, step: int, *, policy: SavePolicy | None = None) -> bool:
        """This process's decision alone, for adapters that agree on it across ranks themselves.

        Each call is a decision point: the time between them, with and without a save being
        written, measures how much a save slows training (``summary()["write_slowdown"]``).

        Args:
            step: this decision point's step.
            policy: ask this policy instead of the engine's ``save_policy`` (an adapter's own).

        Raises:
            ConfigError: no policy (and no preemption is pending).
        """
        self._check_open()
        with self._lock:
            writing = bool(self._pending)
        known = self._known(step)
        self._history.meter.observe(step, self._clock(), writing)
        if self.preemption_pending():
            return not known
        policy = policy or self._save_policy
        if policy is None:
            raise ConfigError("maybe_save() needs CheckpointEngine(save_policy=...), e.g. Continuous(min_interval_s=30)")
        return not known and bool(policy.should_save(self._history.context(step, writing)))

    def preemption_pending(self) -> bool:
        """A preemption notice arrived and :meth:`finish_preemption` has not run yet."""
        return self._preemption is not None and self._preemption.is_set() and not self._preempt_saved

    def finish_preemption(self) -> None:
        """Wait up to ``preemption_grace_s`` for pending commits and uploads; set :attr:`preempted`."""
        self._preempt_saved = True
        log.warning("%s preempted: waiting up to %.0f s for the commit and upload", self._prefix(), self._grace_s)
        drain_within(self.wait, self._grace_s)

    @property
    def preempted(self) -> bool:
        """A preemption notice arrived and its checkpoint was handled: the loop should stop."""
        return self._preempt_saved

    def summary(self) -> dict[str, float | int | None]:
        """How checkpointing went so far: saves, intervals, stall fraction, upload lag.

        Keys: ``saves``; ``interval_p50_s``/``interval_p90_s`` and ``interval_p50_steps``
        (between save starts); ``stall_p50_s`` and ``save_p50_s`` (a save's stall, and its time
        from the call to committed locally); ``stall_fraction`` (the share of wall time since the
        engine started that ``save()`` blocked the caller); ``write_slowdown`` (how much longer training
        takes between decision points while a save is being written, 0.2 = 20%; measured with
        ``maybe_save``/``should_save``); ``upload_lag_p50_s`` (local commit to remote commit).
        ``None`` where there is nothing to measure yet.
        """
        return self._history.summary()

    def decision_context(self, step: int) -> DecisionContext:
        """What a save-decision policy sees at ``step`` now (the last save, whether one is in flight, costs)."""
        with self._lock:
            in_flight = bool(self._pending)
        return self._history.context(step, in_flight)

    def _write_and_commit(self, handle: SaveHandle, buf: StagingBuffer, base: Manifest, staged_at: float,
                          signature: str) -> None:
        """Writer thread: write and commit one checkpoint, then apply retention."""
        step = handle.step
        error: BaseException | None = None
        manifest = base
        try:
            manifest = self._commit_local(handle, buf, base, staged_at, signature)
        except BaseException as e:  # recorded on the handle and raised once by a later call
            error = self._describe_failure(e, step)
        else:
            try:
                self._apply_retention()
            except BaseException as e:
                error = PersistError(f"checkpoint step={step} was committed, but local retention failed: {e}")
                error.__cause__ = e
        with self._lock:
            del self._pending[step]
            if error is not None:
                self._unreported.append(handle)
        if error is not None:
            log.error("%s %s", self._prefix(step), error)
            handle._set_failed(error)
            return
        self._queue_upload(handle, manifest)  # queued before wait_local() returns, so waiters see it pending
        handle._set_local_done()

    # ------------------------------------------------------------------ remote

    def _queue_upload(self, handle: SaveHandle, manifest: Manifest) -> None:
        if self._sync is None:
            handle._set_remote_done()
            return
        ckpt = checkpoint_dir(self._root, handle.step)
        with self._lock:
            self._syncing[handle.step] = (handle, time.monotonic())
        self._sync.submit(SyncJob(local_ckpt=ckpt, manifest=manifest, committed_at=time.monotonic()))

    def _resume_uploads(self) -> None:
        """Queue committed local checkpoints the remote lacks (a previous run died before syncing)."""
        assert self._sync is not None
        remote = self._sync.remote_steps()
        for info, manifest in discover(self._root):
            if info.step not in remote:
                log.info("%s queueing upload of %s left unsynced by an earlier run", self._prefix(info.step), info.path)
                self._queue_upload(SaveHandle(SaveStats(step=info.step, nbytes=info.nbytes)), manifest)

    def _on_synced(self, job: SyncJob, outcome: str, error: BaseException | None, upload_s: float) -> None:
        """Sync thread: record one upload's outcome on its handle."""
        with self._lock:
            handle, _ = self._syncing.pop(job.step)
            latest = self._latest_step
            if error is not None:
                self._unreported.append(handle)
        if outcome == "uploaded":
            handle._update(upload_s=upload_s, upload_gbps=job.manifest.nbytes / upload_s / 1e9 if upload_s > 0 else None,
                           lag_s=time.monotonic() - job.committed_at, lag_steps=max(0, latest - job.step))
        elif outcome == "superseded":
            handle._update(superseded=True)
        if error is not None:
            if outcome == "uploaded":
                error = PersistError(f"checkpoint step={job.step} was uploaded, but remote retention failed: {error}")
            log.error("%s %s", self._prefix(job.step), error)
            handle._set_failed(error)
            return
        try:
            self._apply_retention()  # what waited for this upload may go now
        except BaseException as e:
            log.error("%s local retention failed after the upload: %s", self._prefix(job.step), e)
            with self._lock:
                self._unreported.append(handle)
            handle._set_failed(PersistError(f"local retention failed after uploading step={job.step}: {e}"))
            return
        handle._set_remote_done()

    def _commit_local(self, handle: SaveHandle, buf: StagingBuffer, base: Manifest, staged_at: float,
                      signature: str) -> Manifest:
        """Write the staged shard and commit it with the other ranks; returns the manifest committed."""
        step = handle.step
        timing: dict[str, Any] = {}

        settled = self._direct_io != "auto"

        def write_shard(tmp: Path) -> FileEntry:
            t0 = time.perf_counter()
            if settled:  # the next save may copy into what is written already
                self._pool.writing(buf)
            written = write_file(tmp / shard_filename(self._coll.rank), buf.memoryview(handle.stats.nbytes),
                                 pool=self._io, chunk_bytes=self._settings.chunk_bytes, direct_io=self._direct_io,
                                 ops=self._ops,
                                 on_chunk=(lambda offset, n: self._pool.chunk_written(buf, offset, n)) if settled else None)
            if not settled:  # "auto" found out what this file system takes; keep to it
                self._direct_io = "on" if written.direct_io else "off"
            timing.update(write_s=time.perf_counter() - t0, direct_io=written.direct_io)
            return FileEntry(name=written.name, rank=self._coll.rank, size=written.size, checksum=CHECKSUM_ALGORITHM,
                             chunk_bytes=written.chunk_bytes, chunks=written.chunks)

        manifest = commit_checkpoint(self._root, base, signature, coll=self._coll, write_shard=write_shard,
                                     release=lambda: self._pool.release(buf), ops=self._ops)
        write_s = timing["write_s"]
        handle._update(write_s=write_s, write_gbps=handle.stats.nbytes / write_s / 1e9 if write_s > 0 else None,
                       commit_s=time.perf_counter() - staged_at, direct_io=timing["direct_io"])
        log.info("%s committed %s (%.1f MB, %.2f GB/s)", self._prefix(step), checkpoint_dir(self._root, step),
                 handle.stats.nbytes / 1e6, handle.stats.write_gbps or 0.0)
        return manifest

    def prune(self) -> None:
        """Apply the retention policies to both tiers now.

        They also run after every commit and every upload; call this when what a policy keeps
        has changed in between (an adapter dropped a reference), e.g. before closing.
        Pending and uploading checkpoints and the newest one are kept as always.
        """
        self._check_open()
        self._apply_retention()
        if self._sync is not None:
            self._sync.apply_retention()

    def _apply_retention(self) -> None:
        if self._keep_local is None or not self._leader:
            return
        with self._retention_lock:
            with self._lock:
                protected = set(self._pending) | set(self._syncing)
            context = RetentionContext(tier="local", now=time.time())
            for info in to_delete(self.list(), self._keep_local, context=context, protected=protected):
                log.info("%s retention (%r) removes %s", self._prefix(info.step), self._keep_local, info.path)
                remove_checkpoint(Path(info.path))

    def _describe_failure(self, e: BaseException, step: int) -> BaseException:
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

    # ------------------------------------------------------------------ drain

    def _check_open(self) -> None:
        if self._closed:
            raise PersistError(f"this CheckpointEngine on {self._root} is closed; create a new one")

    def _raise_unreported(self) -> None:
        while True:
            with self._lock:
                if not self._unreported:
                    return
                handle = self._unreported.pop(0)
            error = handle.take_error()
            if error is not None:
                raise error

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed locally and, with a remote, uploaded.

        Raises:
            TimeoutError: something is still pending after ``timeout`` seconds.
            PersistError: a background failure no other call has raised yet (raised once).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                break
            for handle in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                handle._wait_for(handle._local, left)
        if self._sync is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sync.drain(left):
                raise TimeoutError(f"uploads to {self._tier.url} still pending after {timeout} s")
        self._raise_unreported()

    def close(self) -> None:
        """Wait for pending saves, release threads; raises a background failure once. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            if self._sync is not None:
                self._sync.close()
            if self._tier is not None:
                self._tier.close()
            self._reader.close()
            self._io.shutdown(wait=True)

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except PersistError as background:  # do not mask the body's exception; still report this one
            log.error("%s background failure while leaving on %r: %s", self._prefix(), exc, background)

    # ------------------------------------------------------------------ read

    @property
    def local_dir(self) -> Path:
        return self._root

    @property
    def reader(self) -> CheckpointReader:
        """The engine's read side (same tiers), e.g. for ``reader.step_of(path)`` or ``reader.latest()``."""
        return self._reader

    def list(self, tier: str = "local") -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest and file sizes check, oldest first.

        Args:
            tier: ``"local"``, ``"remote"``, or ``"all"`` (both, each with its ``tier``).

        Raises:
            ConfigError: an unknown tier, or ``"remote"`` without a ``remote_url``.
        """
        return self._reader.list(tier)

    def load(self, step: int | None = None, *, map_location: Any = "cpu", verify: bool | None = None) -> Any:
        """Load the newest committed checkpoint that verifies, or the one for ``step``.

        The local copy is used when it is there and verifies; otherwise the remote copy is
        downloaded into ``local_dir`` (parallel ranged reads, checksums verified) and loaded, so
        a fresh machine with an empty ``local_dir`` resumes with ``engine.load()`` alone. Same
        as :meth:`CheckpointReader.load`.

        Raises:
            CheckpointNotFoundError: nothing committed (for ``step``) on any tier.
            CorruptCheckpointError: no copy of ``step`` verifies (names the file).
        """
        self._check_open()
        return self._reader.load(step, map_location=map_location, verify=verify)
