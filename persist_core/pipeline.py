"""What follows ``save()``, wired once (:class:`Pipeline`): the writer, the upload queue, retention on
both tiers, the record of what is not uploaded, and the history of what each save cost.

After each commit (writer thread, :class:`~persist_core.writer.Writer`) the checkpoint goes to the
upload queue (:mod:`persist_core.sync.queue`) first, then local retention (:class:`~persist_core.policies.retention.Retainer`) runs;
after each upload (sync thread) both tiers' retention runs. On several nodes each node's leader
follows rank 0's upload rounds (:mod:`persist_core.sync.nodes`).
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from persist_core._knobs import WriteSettings, remote_lease_s, run_id_from_env
from persist_core.sync.nodes import Coordinator, Follower, uploads_channel
from persist_core.commit import Nodes
from persist_core.distributed import Collectives, decision_channel
from persist_core.errors import ConfigError, RemoteError, WriteError
from persist_core.fileio import FileOps, no_wait
from persist_core.format.manifest import Manifest
from persist_core.handle import ErrorLedger, SaveHandle, SaveStats
from persist_core.history import HistoryLog
from persist_core.layout import UNSYNCED_NAME
from persist_core.ownership import write_unsynced
from persist_core.policies.retention import Retainer, RetentionPolicy
from persist_core.sidefiles import warn_once
from persist_core.staging import StagingPool
from persist_core.sync.queue import RemoteSync, SyncJob
from persist_core.tiers.local import LocalTier, checkpoint_dir, discover
from persist_core.sync.lease import RemoteLease, local_run_id
from persist_core.timeline import Timeline
from persist_core.tiers.remote import RemoteTier
from persist_core.writer import Writer

log = logging.getLogger(__name__)


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
        remote_timeout_s / max_unsynced_bytes / run_id / start_over: see :class:`CheckpointEngine`.
    """

    def __init__(self, root: Path, *, pool: StagingPool, coll: Collectives, ops: FileOps, ledger: ErrorLedger,
                 settings: WriteSettings, tier: RemoteTier | None, keep_local: RetentionPolicy | None,
                 keep_remote: RetentionPolicy | None, latest_step: Callable[[], int], remote_timeout_s: float = 300.0,
                 max_unsynced_bytes: int | None = None, run_id: str | None = None,
                 turn: Callable[[], None] = no_wait, yielding: Callable[[], bool] = lambda: False,
                 slowdown: Callable[[], float | None] = lambda: None, start_over: bool = False) -> None:
        self._root = root
        self._slowdown = slowdown  # recorded with each commit: a restarted job's decisions start from it
        self._turn = turn
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
                             direct_io=settings.direct_io, on_nodes=self._on_nodes, turn=turn,
                             yielding=yielding)
        local = LocalTier(root)
        self.local = Retainer(local, keep_local, protected=self.protected)
        self._url = None if tier is None else tier.url  # before RemoteSync: its thread may upload a backlog at once
        self._record_lock = threading.Lock()
        self.sync = None if tier is None or not leader else RemoteSync(
            tier, keep_remote=keep_remote, ledger=ledger, backlog=self._backlog, after_upload=self._after_upload,
            latest_step=latest_step, lease=RemoteLease(tier, run_id or run_id_from_env() or local_run_id(root),
                                                       ttl_s=remote_lease_s()),
            abandoned=local.abandoned_manifests)
        chan = decision_channel(coll)
        agree = chan.broadcast if chan is not None and chan.world_size > 1 else (lambda refusal: refusal)
        self.timeline = Timeline(root, local, self.sync, leader=leader, url=self._url, start_over=start_over,
                                 listing_timeout_s=remote_timeout_s, agree=agree)
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
            slowdown = self._slowdown()
            self.history.record("committed", handle.stats, time=manifest.time,
                                **({} if slowdown is None else {"write_slowdown": slowdown}))
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
            except ConfigError as e:  # a link where the record goes: never written through (said once)
                warn_once(log, str(self._root / UNSYNCED_NAME), "could not record the un-synced steps in %s: %s", self._root, e)
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
