"""This rank's side of "not yet uploaded" (:class:`SyncSide`): the one object the pipeline talks to.

What a rank does depends on where it is: rank 0 with a ``remote_url`` runs the upload queue
(:class:`~persist_core.sync.queue.UploadQueue`); on several nodes, every other rank follows rank 0's upload
rounds (:class:`~persist_core.sync.nodes.Follower`); without a remote, nothing is uploaded. Whichever it is,
:meth:`SyncSide.protected` is what local retention must keep here, and the un-synced record
(:class:`~persist_core.sync.record.UnsyncedRecord`) is rewritten when that may have changed.

Who calls what: the training thread constructs it, calls :meth:`~SyncSide.start` once the pipeline's callbacks
can run, :meth:`~SyncSide.check_backlog` before a save, :meth:`~SyncSide.drain` and :meth:`~SyncSide.close`; the
writer thread calls :meth:`~SyncSide.committed` after each commit and :meth:`~SyncSide.on_nodes` at the first
save; the sync thread calls back ``after_upload``; a follower thread calls back ``retain``.
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from persist_core._knobs import remote_lease_s
from persist_core.distributed import Collectives
from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, RemoteError, WriteError
from persist_core.format.manifest import Manifest
from persist_core.handle import ErrorLedger, SaveHandle, SaveStats
from persist_core.policies.retention import RetentionPolicy
from persist_core.sync.job import SyncJob
from persist_core.run_ids import run_id_of
from persist_core.sync.lease import RemoteLease
from persist_core.sync.nodes import Coordinator, Follower, uploads_channel
from persist_core.sync.queue import UploadQueue
from persist_core.sync.record import UnsyncedRecord, read_backlog
from persist_core.tiers.local import checkpoint_dir, discover, read_manifest
from persist_core.tiers.remote import RemoteTier

if TYPE_CHECKING:  # the save flow's type only: the save flow hands to sync, never the other way
    from persist_core.save.commit import Nodes

log = logging.getLogger(__name__)


class SyncSide:
    """This rank's side of uploads: the queue (rank 0) or the rounds (other nodes), protection, the record.

    Args:
        root: ``local_dir``.
        coll: the collectives.
        tier: the remote tier, or ``None``.
        ledger: where failures go (raised once by the engine).
        keep_remote: the remote's retention policy.
        latest_step: the newest step saved (for upload lag).
        pending: the steps being written here (the writer's; kept whatever the remote holds).
        ours: the steps this engine reserved (never a start-up backlog's).
        committed_steps: the committed steps in ``root``.
        abandoned: the local set-aside checkpoints (their remote copies are set aside too).
        node_leader: this rank looks after its node's directory.
        after_upload: sync thread, after each upload: the pipeline's records and local retention; may raise.
        retain: follower thread, after each upload round: this node's local retention.
        remote_timeout_s / max_unsynced_bytes / run_id: see :class:`~persist_core.engine.CheckpointEngine`.
    """

    def __init__(self, root: Path, *, coll: Collectives, tier: RemoteTier | None, ledger: ErrorLedger,
                 keep_remote: RetentionPolicy | None, latest_step: Callable[[], int],
                 pending: Callable[[], set[int]], ours: Callable[[], set[int]],
                 committed_steps: Callable[[], list[int]],
                 abandoned: Callable[[], list[tuple[int, int, Manifest, str]]],
                 node_leader: Callable[[], bool], after_upload: Callable[[SyncJob], None],
                 retain: Callable[[], None], remote_timeout_s: float = 300.0,
                 max_unsynced_bytes: int | None = None, run_id: str | None = None) -> None:
        self._root = root
        self._coll = coll
        self._tier = tier
        self._url = None if tier is None else tier.url
        self._pending = pending
        self._ours = ours
        self._committed_steps = committed_steps
        self._node_leader = node_leader
        self._retain = retain
        self._remote_timeout_s = remote_timeout_s
        self._max_unsynced = max_unsynced_bytes
        self._gave_up = False  # the last drain gave up on the remote
        self.follower: Follower | None = None  # every other rank's part in the upload rounds (several nodes)
        self._record = None if tier is None else UnsyncedRecord(
            root, tier.url, self.protected, newest=lambda: max(self._committed_steps(), default=None))
        #: the upload queue (rank 0 with a remote), else ``None``
        self.queue = None if tier is None or coll.rank != 0 else UploadQueue(
            tier, keep_remote=keep_remote, ledger=ledger, backlog=self._backlog, after_upload=after_upload,
            latest_step=latest_step, lease=RemoteLease(tier, run_id_of(root, run_id),
                                                       ttl_s=remote_lease_s()),
            abandoned=abandoned, local_job=self._local_job)

    def start(self) -> None:
        """Start the sync thread (once the callbacks given can run: it may upload a backlog at once)."""
        if self.queue is not None:
            self.queue.start()

    def adopt_remote_run(self) -> None:
        """This run resumed from a checkpoint downloaded from the remote: continue the run holding its lease."""
        if self.queue is not None:
            self.queue.adopt_lease(self._root)

    def on_nodes(self, nodes: Nodes) -> None:
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
        if self.queue is not None:
            self.queue.set_peers(Coordinator(channel, self.queue.unsynced_steps))
        else:
            self.follower = Follower(self._root, channel, self._tier, after_round=self._after_round)

    def _after_round(self) -> None:
        """Follower thread, after each upload round: this node's record of what is not uploaded (for
        ``persist gc`` on this node's directory), then its retention."""
        if self._node_leader():
            self.record()
            self._retain()

    def protected(self) -> set[int]:
        """Steps local retention must keep: pending here, or not uploaded yet (queued, uploading, failed).

        Until the remote has been listed once (a job restarted during an outage), nobody knows what it
        lacks: every local checkpoint is kept. On another node's leader: what rank 0 says is not uploaded.
        """
        pending = self._pending()  # first: a step leaves it only once the upload queue has it
        if self.follower is not None:
            return pending | self.follower.protected()
        if self.queue is None:
            if self._tier is not None and self._coll.rank != 0:  # several nodes, no upload rounds: keep all
                return pending | set(self._committed_steps())
            return pending
        if not self.queue.listed:
            return pending | set(self._committed_steps())
        return pending | self.queue.unsynced_steps()

    def committed(self, handle: SaveHandle, manifest: Manifest) -> None:
        """Writer thread, after each commit: hand the checkpoint to the upload queue (or end its remote phase
        where this rank uploads nothing), then rewrite the record."""
        if self.queue is None:
            handle._set_remote_done()
            if self.follower is not None and self._node_leader():  # another node's directory: its own record
                self.record()
        else:
            self.queue.submit(SyncJob(local_ckpt=checkpoint_dir(self._root, handle.step), manifest=manifest,
                                      handle=handle, committed_at=time.monotonic()))
            self.record()

    def drained(self) -> None:
        """Nothing is pending here and every upload ended: rewrite the record once more where this rank keeps one
        (the rewrites after the last commit and its upload may have seen the step still pending)."""
        if self._record is not None and (self.queue is not None or (self.follower is not None and self._node_leader())):
            self._record.write()

    def record(self) -> None:
        """Rewrite ``local_dir``'s record of what is not uploaded yet, for ``persist gc`` (best effort)."""
        assert self._record is not None
        self._record.write()

    def _backlog(self, remote_steps: set[int]) -> list[SyncJob]:
        """Sync thread, at start-up: the committed local checkpoints an earlier run left un-synced: those its record
        names and those committed after it was written (:func:`~persist_core.sync.record.read_backlog`), that the
        remote lacks; without a record that can say, every one the remote lacks."""
        ours = self._ours()  # read first: a step it saves is reserved before it can be found committed
        assert self._url is not None
        recorded = read_backlog(self._root, self._url)

        def wanted(step: int) -> bool:
            if step in remote_steps or step in ours:
                return False
            return recorded is None or step in recorded[0] or step > recorded[1]

        return [SyncJob(local_ckpt=Path(info.path), manifest=manifest, committed_at=time.monotonic(),
                        handle=SaveHandle(SaveStats(step=info.step, nbytes=info.nbytes)))
                for info, manifest in discover(self._root) if wanted(info.step)]

    def _local_job(self, step: int) -> SyncJob | None:
        """Sync thread: a job for committed local checkpoint ``step`` (one an upload references and the remote
        lacks), or ``None`` when it is not here."""
        ckpt = checkpoint_dir(self._root, step)
        try:
            manifest = read_manifest(ckpt)
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            log.warning("[step=%d] referenced by a checkpoint to upload, but not on %s nor readable in %s: %s", step,
                        self._url, self._root, e)
            return None
        log.info("[step=%d] uploading it again from %s: a checkpoint to upload references it", step, ckpt)
        return SyncJob(local_ckpt=ckpt, manifest=manifest, committed_at=time.monotonic(),
                       handle=SaveHandle(SaveStats(step=step, nbytes=manifest.nbytes)))

    def backlog(self) -> dict[str, float | int | None]:
        """How far behind the remote is (see :meth:`UploadQueue.backlog`); empty where this rank has no queue."""
        return {} if self.queue is None else self.queue.backlog()

    def prune(self) -> None:
        """Apply the remote's retention now (rank 0)."""
        if self.queue is not None:
            self.queue.apply_retention()

    def check_backlog(self, step: int, nbytes: int) -> None:
        """Refuse a save that would pile more un-synced bytes than the cap (an outage); nothing is deleted.

        Without ``max_unsynced_bytes`` the cap holds only while the remote fails: with the remote answering, a nearly
        full disk is the disk's to report (the save's own write fails on it, as it would without a remote).

        Raises:
            WriteError: the cap (``max_unsynced_bytes``, else 10% of the disk left free) would be passed.
        """
        backlog = 0 if self.queue is None else self.queue.unsynced_bytes()
        if not backlog:
            return
        failing = self.queue.failing
        if self._max_unsynced is not None:
            full, limit = backlog + nbytes > self._max_unsynced, f"max_unsynced_bytes={self._max_unsynced}"
        elif not failing:
            return
        else:
            disk = shutil.disk_usage(self._root)
            full, limit = disk.free - nbytes < 0.1 * disk.total, f"10% of {self._root}'s file system free"
        if full:
            why = f"uploads failing: {self.queue.failures} attempts" if failing else "uploads under way"
            raise WriteError(errno.ENOSPC, (
                f"checkpoint step={step} not saved: {backlog} bytes of checkpoints ({sorted(self.queue.unsynced_steps())}) "
                f"still wait for {self._url} ({why}), and {nbytes} more would pass {limit}. Nothing was deleted; "
                "restore the remote (or pass a larger max_unsynced_bytes) and save again"))

    def drain(self, deadline: float | None, timeout: float | None, *, closing: bool) -> None:
        """Block until nothing is un-synced (once the writer drained; ``deadline``: ``time.monotonic()``).

        Raises:
            TimeoutError: ``timeout`` ran out first.
            RemoteError: uploads still fail after ``remote_timeout_s``; names the un-synced steps
                (committed locally and protected there; the next engine uploads them). ``closing`` right after
                such a failure waits no second ``remote_timeout_s``.
        """
        remote_wait_s = min(0.5, self._remote_timeout_s) if closing and self._gave_up else self._remote_timeout_s
        try:
            self._drain(deadline, timeout, remote_wait_s)
        except RemoteError:
            self._gave_up = True
            raise
        self._gave_up = False

    def _drain(self, deadline: float | None, timeout: float | None, remote_wait_s: float) -> None:
        if self.queue is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        bounded = left is None or left > remote_wait_s
        if self.queue.drain(remote_wait_s if bounded else left):
            return
        if not bounded:
            raise TimeoutError(f"uploads to {self._url} still pending after {timeout} s")
        steps = sorted(self.queue.unsynced_steps())
        raise RemoteError(
            f"uploads to {self._url} did not complete within remote_timeout_s={self._remote_timeout_s:g}: un-synced steps "
            f"{steps} ({self.queue.failures} failed attempts so far). They stay committed in {self._root} and are "
            "never deleted before they are uploaded; a later wait(), or the next engine on this directory, uploads them")

    def close(self) -> None:
        """Finish the uploads (after giving up on the remote: only the one under way), then stop the threads."""
        if self.queue is not None:  # after giving up on the remote, do not upload the queue at close
            self.queue.close(give_up=self._gave_up, give_up_after_s=max(5.0, self._remote_timeout_s))
            if self.queue.peers is not None and not self.queue.running:
                self.queue.peers.stop()  # the other ranks' upload rounds end
        if self.follower is not None:  # rank 0 says stop once its queue is done
            self.follower.close(timeout_s=max(60.0, 3 * self._remote_timeout_s))
