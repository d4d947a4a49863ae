"""One upload, on the sync thread (:class:`Uploader`): what an attempt does and what its handle is told.

An attempt, in order: the lease is taken or renewed (another run's live lease: nothing is written); the old
branch is set aside (:class:`~persist_core.sync.aside.RemoteAside`); the checkpoint goes up (written on several
nodes: a round with the other ranks, :class:`~persist_core.sync.nodes.Coordinator`, manifest last); remote
retention runs. The queue (:class:`~persist_core.sync.queue.UploadQueue`) decides what is attempted when and
keeps the jobs; this holds none of them, only which steps' failures were reported already.
"""

from __future__ import annotations

import logging

from persist_core.errors import DirectoryInUseError
from persist_core.handle import ErrorLedger
from persist_core.policies.retention import Retainer
from persist_core.sync.aside import RemoteAside
from persist_core.sync.references import check_on_remote
from persist_core.layout import MANIFEST_NAME
from persist_core.sync.job import SyncJob, explain, wrapped
from persist_core.sync.lease import RemoteLease
from persist_core.sync.nodes import Coordinator
from persist_core.sync.order import KnownRemote
from persist_core.tiers.remote import RemoteTier

log = logging.getLogger(__name__)


class Uploader:
    """Attempts uploads and ends their handles' remote phase (sync thread; :meth:`reported` any thread).

    Args:
        tier: the remote tier.
        known: the remote as the sync thread knows it (an upload adds to it).
        lease: this run's lease on the remote, or ``None``.
        aside: the remote's side of a branch.
        retainer: remote retention over ``known``.
        ledger: where failures go (raised once by the engine).
    """

    def __init__(self, tier: RemoteTier, *, known: KnownRemote, lease: RemoteLease | None, aside: RemoteAside,
                 retainer: Retainer, ledger: ErrorLedger) -> None:
        self._tier = tier
        self._known = known
        self._lease = lease
        self._aside = aside
        self._retainer = retainer
        self._ledger = ledger
        self._reported: set[int] = set()  # steps whose failure went to the ledger already

    def reported(self, step: int) -> bool:
        """The failure of ``step``'s upload went to the ledger already."""
        return step in self._reported

    def attempt(self, job: SyncJob, peers: Coordinator | None,
                unlisted: BaseException | None = None) -> tuple[bool, bool, BaseException | None]:
        """Upload ``job`` (and apply remote retention after it): ``(uploaded, announced to the other ranks,
        what it raised)``. ``unlisted``: why the remote could not be listed just before (then nothing is
        uploaded: it is this attempt's failure)."""
        uploaded = announced = False
        try:
            if unlisted is not None:  # the start-up listing failed, and again now: retried at the next attempt
                raise unlisted
            if self._lease is not None:
                self._lease.ensure()  # another run's live lease: nothing is written, retried later
            self._aside.apply()  # a new branch's first upload waits for the old branch to move aside
            check_on_remote(job, self._known.steps(), self._tier.url)  # what it references is there first
            if job.manifest.node is None:  # this directory holds every file
                self._tier.upload(job.local_ckpt, job.manifest)
            else:  # a node's copy: every rank uploads its own files, the manifest after all of them
                assert peers is not None
                peers.before(job.step)
                announced = True
                self._tier.upload(job.local_ckpt, job.manifest, files=tuple(f for f in job.manifest.held() if f.rank == 0))
            uploaded = True
            self._known.add(job.info(self._tier.url), job.manifest.depends_on())
            self._retainer.apply()
        except BaseException as e:  # recorded on the handle, raised once by the engine
            return uploaded, announced, e
        return uploaded, announced, None

    def lost(self, job: SyncJob, error: BaseException | None) -> BaseException | None:
        """After a failed attempt: the error to report if ``job``'s local checkpoint is gone (another process removed
        it: nothing to retry, said instead of a raw ``FileNotFoundError``), else ``None``."""
        if (job.local_ckpt / MANIFEST_NAME).exists():
            return None
        return wrapped(f"checkpoint step={job.step} was removed from {job.local_ckpt.parent} by another process "
                       f"before its upload to {self._tier.url}; it is not retried", error)

    def apply_retention(self) -> None:
        """Apply remote retention now, where this run holds the lease (or there is none)."""
        if self._lease is None or self._lease.held:
            self._retainer.apply()

    def conclude(self, job: SyncJob, error: BaseException | None, *, uploaded: bool, vanished: bool) -> None:
        """End ``job``'s remote phase, or record its failure: in the ledger once, the retries only logged."""
        if error is None:
            job.handle._set_remote_done()
            return
        if not vanished:
            error = explain(error, job, self._tier, uploaded=uploaded)
        if job.step in self._reported:
            log.debug("[step=%d] retry failed: %s", job.step, error)
            return
        self._reported.add(job.step)
        log.error("[step=%d] %s (kept locally; retried while the job runs)", job.step, error)
        in_use = isinstance(error, DirectoryInUseError)  # a misconfiguration: the next save says so
        self._ledger.fail(job.handle, error, remote=not uploaded and not vanished and not in_use)
