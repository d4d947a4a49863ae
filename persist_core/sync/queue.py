"""The upload queue: one thread uploading committed local checkpoints, oldest first.

It owns "being uploaded": :meth:`UploadQueue.unsynced_steps` is what local retention must keep.

Who calls what (through :class:`~persist_core.sync.side.SyncSide`): the engine's writer thread calls
:meth:`UploadQueue.submit` after each local commit; ``wait()`` calls :meth:`UploadQueue.drain`; the sync
thread uploads, applies remote retention (over what it knows the remote holds), ends each handle's
remote phase (or records its failure in the ledger), then calls ``after_upload`` (the engine: local
retention, since what waited for this upload may go now).

Start-up happens on the sync thread too, never on the caller's: it lists the remote once and
queues what an earlier run left un-synced (``backlog``: what its record names, that the remote lacks). A
remote that cannot be reached is found out there, like any upload failure.

Outages (:class:`~persist_core.sync.outage.Outage`): a job whose upload fails stays *un-synced* (protected from
local retention) and is retried on a backoff timer while the job runs, and at once when ``drain`` is called or another
upload succeeds: the newest checkpoint first, then the backlog, oldest first. Its failure is recorded in
the ledger once (the handle's own ``wait`` raises it); the engine's ``save`` never raises it.
Until the remote has been listed once, every local checkpoint counts as un-synced (:attr:`listed`).

Back-pressure: when a new job arrives, queued jobs that have not started and that the remote
retention policy would not keep are superseded by it. Milestones (kept by the policy) are never
superseded; with no remote policy, every checkpoint is kept, so none is. Incremental saves: a job another
un-synced job references is never superseded, goes up before it, and stays on the remote while it is
un-synced (:mod:`persist_core.sync.references`).

The pieces without the queue's state are elsewhere: the job and what a failure says in :mod:`persist_core.sync.job`;
the remote as known and the order in :mod:`persist_core.sync.order`; what one attempt does in
:class:`persist_core.sync.upload.Uploader`; the remote's side of a branch in
:class:`persist_core.sync.aside.RemoteAside`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from persist_core.format.manifest import Manifest
from persist_core.handle import ErrorLedger
from persist_core.policies.retention import Retainer, RetentionPolicy
from persist_core.sync.aside import RemoteAside
from persist_core.sync.references import References
from persist_core.sync.job import SyncJob, behind, end_superseded, not_uploaded_at_close
from persist_core.sync.lease import RemoteLease
from persist_core.sync.nodes import Coordinator
from persist_core.sync.order import KnownRemote, UploadOrder
from persist_core.sync.outage import Outage
from persist_core.sync.upload import Uploader
from persist_core.tiers.remote import RemoteTier

__all__ = ["Backlog", "UploadQueue", "SyncJob"]

log = logging.getLogger(__name__)


#: ``backlog(remote_steps)``: the jobs to queue at start-up for what the remote lacks (sync thread)
Backlog = Callable[[set[int]], list[SyncJob]]


class UploadQueue:
    """Uploads jobs in step order on one thread, then applies ``keep_remote`` on the remote.

    Args:
        tier: the remote tier.
        keep_remote: the remote's retention policy (``None`` keeps everything).
        ledger: where failures go (raised once by the engine).
        backlog: called once on the sync thread with the remote's steps; its jobs are queued.
        after_upload: called with each job that ends uploaded (the engine's record, local retention); may raise.
        latest_step: the newest step saved so far (for ``lag_steps``).
        lease: this run's lease on the remote, taken or renewed before every write there.
        abandoned: the local set-aside checkpoints (their remote copies are set aside too, at start).
        local_job: a job for committed local checkpoint ``step`` (``None``: not there), queued when a job references
            it and the remote lacks it.
    """

    def __init__(self, tier: RemoteTier, *, keep_remote: RetentionPolicy | None, ledger: ErrorLedger,
                 backlog: Backlog, after_upload: Callable[[SyncJob], None], latest_step: Callable[[], int],
                 lease: RemoteLease | None = None,
                 abandoned: Callable[[], list[tuple[int, int, Manifest, str]]] | None = None,
                 local_job: Callable[[int], SyncJob | None] = lambda step: None) -> None:
        self._tier = tier
        #: rank 0's side of the upload rounds with the other ranks (several nodes), set once they are found
        self.peers: Coordinator | None = None
        self._waiting: dict[int, SyncJob] = {}  # node copies an earlier run left, until peers are set
        self._lease = lease
        self._keep = keep_remote
        self._ledger = ledger
        self._backlog = backlog
        self._after_upload = after_upload
        self._latest_step = latest_step
        self._known = KnownRemote(tier)
        self._refs = References(self._known, self._unsynced, local_job, abandoned)
        self._order = UploadOrder(keep_remote, self._known)
        self._aside = RemoteAside(tier, self._known, abandoned)
        self._uploader = Uploader(tier, known=self._known, lease=lease, aside=self._aside, ledger=ledger,
                                  retainer=Retainer(self._known, keep_remote, protected=self._queued_steps,
                                                    referenced=self._refs.kept_remotely,
                                                    references=self._known.depends_on))
        self._cond = threading.Condition()
        self._queue: list[SyncJob] = []
        self._outage = Outage(tier.url, tier.backoff_s)  # uploads that failed: retried, protected meanwhile
        self._active: SyncJob | None = None  # being uploaded: protected from local retention
        self._busy = True  # the thread is working (start-up, or a job until its outcome is recorded)
        self._refused: dict[int, SyncJob] = {}  # not uploaded because of it: kept (protected), never retried
        self._stopping = False
        self._gave_up = False  # close() after remote_timeout_s: nothing more is started
        # a daemon: close() waits for it, except for a request the remote never answers after giving up
        self._thread = threading.Thread(target=self._run, name="persist-sync", daemon=True)

    def start(self) -> None:
        """Start the sync thread, once the callbacks given can run (it may upload a backlog at once)."""
        self._thread.start()
        # at interpreter exit (an engine never closed): finish the queued uploads, then stop, as concurrent.futures
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._stop)

    # ---- any thread

    @property
    def listed(self) -> bool:
        """The remote has been listed once (until then nobody knows what it lacks)."""
        return self._known.listed

    def _unsynced(self) -> dict[int, SyncJob]:
        """The jobs not uploaded yet: queued, uploading, failed or waiting for the other nodes, by step."""
        with self._cond:
            return {j.step: j for j in [*self._queue, *self._outage.failed.values(), *self._waiting.values(),
                                        *self._refused.values(), *([self._active] if self._active else [])]}

    def set_peers(self, peers: Coordinator) -> None:
        """The other ranks take part in uploads from now on (the first save found them on several nodes):
        what waited for them is queued."""
        with self._cond:
            self.peers = peers
            self._queue = self._order.ordered([*self._queue, *self._waiting.values()])
            self._waiting.clear()
            self._cond.notify_all()

    def wait_listed(self, timeout: float) -> set[int] | None:
        """Wait (at most ``timeout`` s) for the start-up listing to be tried: the remote's steps as first listed
        (before this run uploaded anything), or ``None`` when it could not be listed (an outage) in time."""
        return self._known.wait_listed(timeout)

    def fresh_run(self, refusal: Callable[[set[int]], Exception]) -> None:
        """This run loaded nothing and the remote was not listed yet: once it is, committed checkpoints there
        (another run's) mean nothing of this run is uploaded; ``refusal(steps)`` says why, once, through the
        ledger, and the checkpoints stay committed locally (any thread)."""
        self._known.fresh_run(refusal)

    def known_steps(self) -> set[int]:
        """The remote's committed steps as this thread knows them (empty until it is listed)."""
        return self._known.steps()

    def unsynced_steps(self) -> set[int]:
        """Steps queued, uploading or failed: local retention must keep them."""
        return set(self._unsynced())

    @property
    def failing(self) -> bool:
        """The remote is failing now: the last listing or upload failed, or a failed upload waits to be retried."""
        with self._cond:
            return self._outage.down or bool(self._outage.failed)

    @property
    def failures(self) -> int:
        """Failed upload (and listing) attempts, all told."""
        return self._outage.failures

    def unsynced_bytes(self) -> int:
        return sum(j.manifest.nbytes for j in self._unsynced().values())

    def backlog(self) -> dict[str, float | int | None]:
        """How far behind the remote is: un-synced checkpoints, their bytes, the oldest one's age (s)."""
        return behind(list(self._unsynced().values()), self.failures)

    def _queued_steps(self) -> set[int]:
        with self._cond:
            return {j.step for j in self._queue}

    def submit(self, job: SyncJob) -> None:
        """Queue ``job`` (writer thread); may supersede queued jobs the remote policy would drop.

        Raises:
            ConfigError: the remote policy answered the wrong number of times (``job`` stays queued).
        """
        with self._cond:
            self._outage.failed.pop(job.step, None)
            self._queue.extend(self._refs.lacking([job]))
            self._queue.append(job)
            try:
                superseded = self._supersede()
            finally:
                self._cond.notify_all()
        end_superseded(superseded, "upload superseded by a newer checkpoint (remote is behind)")

    def _supersede(self) -> list[SyncJob]:
        """Drop queued jobs, except the newest, that the remote policy would not keep (lock held)."""
        dropped = self._order.superseded(self._queue, self._active, [*self._outage.failed.values(),
                                                                    *self._waiting.values(), *self._refused.values()])
        self._queue = [j for j in self._queue if j not in dropped]
        return dropped

    def adopt_lease(self, root: Path) -> None:
        """Continue the run that holds the remote's lease (see :meth:`RemoteLease.adopt`)."""
        if self._lease is not None:
            self._lease.adopt(root)

    def start_branch(self, at: int) -> None:
        """A run resumed from ``at`` saves past it: before its next upload, the remote's newer checkpoints
        are set aside (kept under abandoned names); queued or failed uploads of them are dropped."""
        with self._cond:
            self._aside.branch(at)
            dropped = [j for j in self._queue if j.step > at] + self._outage.drop_after(at)
            self._queue = [j for j in self._queue if j.step <= at]
        end_superseded(dropped, f"not uploaded: set aside locally by the branch from step {at}")
        with self._cond:  # the sync thread takes them off the live branch as soon as it is free (one writer)
            self._aside.ask_hide(at)
            self._cond.notify_all()
        self._aside.wait_hidden(at)

    def drain(self, timeout: float | None = None) -> bool:
        """Retry failed uploads now and wait until nothing is queued, uploading or failed.

        Returns ``False`` if ``timeout`` ran out first (:meth:`unsynced_steps` says what is left).
        """
        with self._cond:
            self._outage.retry_now = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._queue and not self._busy and not self._outage.failed,
                                       timeout)

    def apply_retention(self) -> None:
        """Apply ``keep_remote`` to the remote now (the sync thread also does after each upload)."""
        if self._known.listed:
            self._uploader.apply_retention()

    def close(self, *, give_up: bool = False, give_up_after_s: float = 30.0) -> None:
        """Finish every queued upload, then stop the thread.

        With ``give_up`` (a drain already waited ``remote_timeout_s`` in vain) only the upload under
        way goes on, for at most ``give_up_after_s``: a remote that stopped answering mid-request must
        not hold ``close()``. The queued ones stay committed locally and recorded as un-synced, for
        the next engine, and their handles fail with a ``RemoteError`` saying so.
        """
        dropped: list[SyncJob] = []
        if give_up:
            with self._cond:  # kept with the failed ones: still un-synced (protected, recorded), not retried
                dropped, self._queue = self._queue, []
                self._outage.failed.update({j.step: j for j in dropped})
                self._gave_up = True
        for job in dropped:
            if not self._uploader.reported(job.step):
                self._ledger.fail(job.handle, not_uploaded_at_close(job, self._tier.url), remote=True)
        self._stop()
        self._thread.join(give_up_after_s if give_up else None)
        if self._thread.is_alive():  # stuck in a request the remote never answers: leave it (a daemon thread)
            log.error("an upload to %s is still in flight %.0f s after giving up; closing without it (its checkpoint "
                      "stays committed locally and un-synced; the next engine uploads it)", self._tier.url,
                      give_up_after_s)
            return
        if self._lease is not None:
            self._lease.release()

    @property
    def running(self) -> bool:
        """The sync thread is still alive (stuck in a request after close gave up on it)."""
        return self._thread.is_alive()

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- the sync thread

    def _start(self) -> None:
        """List the remote, then queue what an earlier run left unsynced.

        Raises:
            RemoteError: the remote cannot be listed (the next upload tries again, and reports it).
        """
        self._known.load()
        self._aside.listed()
        backlog = self._backlog(self._known.steps())
        for job in backlog:
            log.info("[step=%d] queueing the upload of %s left unsynced by an earlier run", job.step, job.local_ckpt)
        with self._cond:  # the newest first, then milestones, then the rest; superseded as at submit
            jobs = [*self._queue, *backlog]
            jobs += self._refs.lacking(jobs)  # what they reference that the remote lacks (before them)
            if len(jobs) != len(self._queue):
                self._queue = self._order.ordered(jobs)
            superseded = self._supersede() if backlog else []
            self._cond.notify_all()
        end_superseded(superseded, "upload superseded by a newer checkpoint (remote is behind)")

    def _run(self) -> None:
        try:
            self._start()
        except Exception as e:  # unreachable, no bucket, no access: the first upload finds out and reports it
            with self._cond:
                self._outage.listing_failed()
            log.warning("listing %s failed (%s); the next upload tries again, and checkpoints stay local until "
                        "then", self._tier.url, e)
        finally:
            self._known.tried()
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._queue or self._stopping or self._outage.due() or self._aside.asked,
                                    self._outage.wait_s())
                hide = self._aside.asked
                self._busy = hide
            if hide:
                self._aside.hide_asked(self._lease)
                continue
            with self._cond:
                if not self._queue:
                    if self._stopping:
                        return  # what failed stays committed locally; the next engine uploads it
                    if self._outage.failed:
                        self._requeue_failed()  # the retry timer ran out, or drain() asked
                    if not self._queue:
                        continue
                job = self._active = self._queue.pop(0)
                self._busy = True
            self._upload(job)

    def _requeue_failed(self) -> None:
        """Queue the failed uploads again with what is queued (lock held), in :class:`UploadOrder`'s order."""
        self._queue = self._order.ordered([*self._outage.take(), *self._queue])
        log.info("retrying the upload of steps %s to %s", [j.step for j in self._queue], self._tier.url)

    def _upload(self, job: SyncJob) -> None:
        if job.manifest.node is not None and self.peers is None:
            with self._cond:  # an earlier run's node copy: it waits for this run's ranks (set_peers)
                self._active = None
                self._waiting[job.step] = job
            log.info("[step=%d] checkpoint written on %d nodes: its upload waits for this run's first save (which "
                     "finds the other nodes' ranks to upload their files); it stays committed and protected",
                     job.step, len(job.manifest.nodes))
            return
        unlisted = self._relist()
        if self._refused_before_upload(job):
            return
        t0 = time.perf_counter()
        uploaded, announced, error = self._uploader.attempt(job, self.peers, unlisted)
        upload_s = time.perf_counter() - t0
        lost = None if uploaded else self._uploader.lost(job, error)
        vanished, error = lost is not None, lost or error
        with self._cond:
            self._active = None  # uploaded, or failed and kept (protected) for a retry
            if not uploaded:
                self._outage.upload_failed(job, vanished=vanished)
            else:
                self._outage.uploaded()
                if self._outage.failed and not self._gave_up:  # the remote is back: the newest un-synced next
                    self._requeue_failed()
        if announced:  # the other ranks learn how it ended (and what is still un-synced)
            try:
                self.peers.after(job.step, uploaded=uploaded)
            except Exception as e:
                error = error or e
        if uploaded:
            job.uploaded(upload_s, latest_step=self._latest_step())
            try:
                if error is None:
                    self._after_upload(job)
            except BaseException as e:
                error = e
        self._uploader.conclude(job, error, uploaded=uploaded, vanished=vanished)

    def _relist(self) -> BaseException | None:
        """List the remote if the start-up listing failed (an outage), once per upload attempt: nothing is
        uploaded before it is listed. ``None``, or why it still cannot be (the attempt's failure)."""
        try:
            if not self._known.listed:
                self._start()
        except BaseException as e:  # still down: the attempt reports it, and is retried
            return e
        return None

    def _refused_before_upload(self, job: SyncJob) -> bool:
        """A run that loaded nothing found another run's checkpoints on the remote: ``job`` is not uploaded, it
        stays committed locally (protected) and its handle fails once with the refusal."""
        refusal = self._known.refusal
        with self._cond:
            if refusal is None:
                return False
            self._active = None
            self._refused[job.step] = job
            first = len(self._refused) == 1
        self._ledger.fail(job.handle, refusal, remote=not first)  # raised once; each handle's wait raises it too
        return True
