"""What follows ``save()``, wired once (:class:`Pipeline`): the writer, retention on the local tier, and
the history of what each save cost; everything about the remote goes through one object,
:class:`~persist_core.sync.side.SyncSide`.

After each commit (writer thread, :class:`~persist_core.save.writer.Writer`) the checkpoint goes to the sync
side first (:meth:`SyncSide.committed <persist_core.sync.side.SyncSide.committed>`: the upload queue), then
local retention (:class:`~persist_core.policies.retention.Retainer`) runs, then the watch on the set-aside branches
(:class:`~persist_core.policies.abandoned.AbandonedWatch`: one warning when they outgrow the live one); after each
upload (sync thread)
the records, then local retention. Local retention never touches a step the sync side protects.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from persist_core.config import Config
from persist_core.distributed import Collectives, decision_channel
from persist_core.fileio import FileOps
from persist_core.format.manifest import Manifest
from persist_core.handle import ErrorLedger, SaveHandle
from persist_core.history import HistoryLog
from persist_core.policies.abandoned import AbandonedWatch
from persist_core.policies.retention import Retainer
from persist_core.save.dedup import Incremental
from persist_core.staging.pool import StagingPool
from persist_core.sync import SyncJob, SyncSide
from persist_core.tiers.local import LocalTier
from persist_core.tiers.remote import RemoteTier
from persist_core.timeline import Timeline
from persist_core.save.writer import Writer
from persist_core.turn import NO_TURN, Turn


class Pipeline:
    """What follows ``save()``, wired once: the writer, local retention, and the sync side.

    After each commit (writer thread) the checkpoint goes to the sync side first, then local
    retention runs; after each upload (sync thread) local retention runs again. Local retention
    never touches a step that is pending here or not yet uploaded (:meth:`SyncSide.protected`); only
    rank 0 applies retention on the remote and uploads.

    Args:
        config: the engine's configuration (``local_dir``, how to write, retention, the remote's limits, ...).
        pool / coll / ops / ledger: as for :class:`Writer`.
        tier: the remote tier, or ``None``.
        latest_step: the newest step saved (for upload lag).
        turn: the background I/O's turn (deletes wait for it too).
        slowdown: what a running write costs training now (recorded with each commit).
    """

    def __init__(self, config: Config, *, pool: StagingPool, coll: Collectives, ops: FileOps, ledger: ErrorLedger,
                 tier: RemoteTier | None, latest_step: Callable[[], int], turn: Turn = NO_TURN,
                 slowdown: Callable[[], float | None] = lambda: None) -> None:
        root = config.local_dir
        self._root = root
        self._slowdown = slowdown  # recorded with each commit: a restarted job's decisions start from it
        self._turn = turn
        self.closing = False  # set by close(): a drain right after giving up waits no second remote_timeout_s
        leader = coll.rank == 0
        self._coll = coll
        self.history = HistoryLog(root)  # what each save cost, for persist stats (rank 0 writes it)
        #: incremental saves (issue 43): what the newest committed checkpoint holds is referenced, not rewritten
        self.incremental = (Incremental(root, full_every=config.full_every, in_place=config.memory is None)
                            if config.incremental else None)
        self.writer = Writer(root, pool=pool, coll=coll, ops=ops, ledger=ledger, after_commit=self._after_commit,
                             write_threads=config.write_threads, chunk_bytes=config.chunk_bytes,
                             direct_io=config.direct_io, on_nodes=lambda nodes: self.sync.on_nodes(nodes),
                             turn=turn, incremental=self.incremental)
        local = LocalTier(root)
        planned = self.incremental.planned if self.incremental is not None else set
        self.local = Retainer(local, config.keep_local, protected=lambda: self.sync.protected(),
                              referenced=lambda: planned() | local.abandoned_referenced(),
                              references=local.depends_on)
        #: set-aside branches are kept, but one warning says when they hold more than the live branch
        self.abandoned = AbandonedWatch(local, str(root))
        #: this rank's side of uploads (the queue on rank 0): the one object the remote goes through
        self.sync = SyncSide(root, coll=coll, tier=tier, ledger=ledger, keep_remote=config.keep_remote,
                           latest_step=latest_step,
                           pending=self.writer.pending_steps, ours=self.writer.ours,
                           committed_steps=local.committed_steps, abandoned=local.abandoned_manifests,
                           node_leader=self._node_leader, after_upload=self._after_upload, retain=self.local.apply,
                           remote_timeout_s=config.remote_timeout_s, max_unsynced_bytes=config.max_unsynced_bytes,
                           run_id=config.run_id)
        chan = decision_channel(coll)
        agree = chan.broadcast if chan is not None and chan.world_size > 1 else (lambda refusal: refusal)
        self.timeline = Timeline(root, local, self.sync.queue, leader=leader, url=None if tier is None else tier.url,
                                 start_over=config.start_over, listing_timeout_s=config.remote_timeout_s, agree=agree)
        self.sync.start()  # now that local retention and the record can see it

    def adopt_remote_run(self) -> None:
        """This run resumed from a checkpoint downloaded from the remote: continue the run holding its lease."""
        self.sync.adopt_remote_run()

    def _node_leader(self) -> bool:
        """This rank looks after its node's directory: rank 0, and the first rank of each other node."""
        nodes = self.writer.nodes
        return self._coll.rank == 0 or (nodes is not None and not nodes.shared and nodes.leader)

    def _retain_local(self) -> None:
        """Local retention, where this rank applies it: rank 0, and the leader of each other node (the same
        policy over the same committed steps, keeping what rank 0 says is not uploaded: the same steps go)."""
        if self._node_leader():
            self._turn.wait()  # deleting a checkpoint is kernel work on the cores a guarded update is using
            self.local.apply()

    def _after_commit(self, handle: SaveHandle, manifest: Manifest) -> None:
        """Writer thread: hand the checkpoint to the sync side first, then apply local retention."""
        if self._coll.rank == 0:
            slowdown = self._slowdown()
            self.history.record("committed", handle.stats, time=manifest.time,
                                **({} if slowdown is None else {"write_slowdown": slowdown}))
        self.sync.committed(handle, manifest)
        self._retain_local()
        if self._node_leader():
            self.abandoned.check()

    def _after_upload(self, job: SyncJob) -> None:
        """Sync thread, after each upload: the records first, then local retention (what waited may go)."""
        if job.handle.stats.lag_s is not None:  # this engine's own save (a backlog job's handle has no numbers)
            self.history.record("uploaded", job.handle.stats)
        self.sync.record()
        self._retain_local()

    def prune(self) -> None:
        self._retain_local()
        self.sync.prune()

    def check_backlog(self, step: int, nbytes: int) -> None:
        """Refuse a save that would pile more un-synced bytes than the cap (:meth:`SyncSide.check_backlog`)."""
        self.sync.check_backlog(step, nbytes)

    def drain(self, timeout: float | None) -> None:
        """Block until nothing is pending or un-synced.

        Raises:
            TimeoutError: ``timeout`` ran out first.
            RemoteError: uploads still fail after ``remote_timeout_s`` (:meth:`SyncSide.drain`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.writer.drain(deadline)
        self.sync.drain(deadline, timeout, closing=self.closing)
        self.sync.drained()

    def close(self) -> None:
        self.writer.close()
        self.sync.close()
