"""The order uploads go in: the remote as the sync thread knows it (:class:`KnownRemote`), and which queued
jobs the remote policy would drop and in what order retries go (:class:`UploadOrder`).

:class:`~persist_core.sync.queue.UploadQueue` (the queue and its thread) holds the state; the pieces here hold
none of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from persist_core.policies.retention import RetentionContext, RetentionPolicy, to_delete
from persist_core.sync.references import referenced_first, spared
from persist_core.sync.job import SyncJob
from persist_core.tiers.remote import RemoteTier
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


class KnownRemote:
    """The remote as the sync thread knows it (listed once, then kept up to date): a Tier for retention.

    Its first listing (before this run uploaded anything) also says whose remote it is: a run that loaded
    nothing (:meth:`fresh_run`) may upload nothing beside another run's committed checkpoints (:attr:`refusal`).
    """

    kind = "remote"

    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier
        self.infos: dict[int, CheckpointInfo] = {}
        self._depends: dict[int, set[int]] = {}  # step -> the steps its manifest references (incremental saves)
        self.lock = threading.Lock()
        self.listed = False  # listed once (until then nobody knows what the remote lacks)
        self._tried = threading.Event()  # the start-up listing was tried (listed, or it failed)
        self._first: set[int] | None = None  # the remote's steps as first listed (before any upload)
        #: set when this run loaded nothing (:meth:`fresh_run`): another run's checkpoints there mean no upload
        self._make_refusal: Callable[[set[int]], Exception] | None = None
        self._refusal: Exception | None = None  # why nothing of this run may be uploaded

    def load(self) -> None:
        """List the remote (sync thread): what is known from now on; the first time, whose remote it is.

        Raises:
            RemoteError: the remote cannot be listed.
        """
        listing = self._tier.listing()
        with self.lock:
            self.infos = {i.step: i for i, _ in listing}
            self._depends = {i.step: m.depends_on() for i, m in listing}
            if self._first is None:
                self._first = set(self.infos)
                if self._make_refusal is not None and self._first:
                    self._refusal = self._make_refusal(self._first)
        self.listed = True

    def tried(self) -> None:
        """The start-up listing was tried (listed, or it failed): :meth:`wait_listed` returns."""
        self._tried.set()

    def wait_listed(self, timeout: float) -> set[int] | None:
        """Wait (at most ``timeout`` s) for the start-up listing to be tried: the remote's steps as first listed
        (before this run uploaded anything), or ``None`` when it could not be listed (an outage) in time."""
        self._tried.wait(timeout)
        with self.lock:
            return None if self._first is None else set(self._first)

    def fresh_run(self, refusal: Callable[[set[int]], Exception]) -> None:
        """This run loaded nothing: committed checkpoints in the first listing (another run's) mean nothing of
        it is uploaded; ``refusal(steps)`` says why (any thread)."""
        with self.lock:
            self._make_refusal = refusal
            if self._first:
                self._refusal = refusal(self._first)

    @property
    def refusal(self) -> Exception | None:
        """Why nothing of this run may be uploaded, or ``None``."""
        with self.lock:
            return self._refusal

    @property
    def location(self) -> str:
        return self._tier.url

    def list(self) -> list[CheckpointInfo]:
        with self.lock:
            return sorted(self.infos.values(), key=lambda c: c.step)

    def steps(self) -> set[int]:
        with self.lock:
            return set(self.infos)

    def depends_on(self, step: int) -> set[int]:
        """The steps remote checkpoint ``step`` references (a :class:`Retainer`'s ``references``)."""
        with self.lock:
            return set(self._depends.get(step, ()))

    def add(self, info: CheckpointInfo, depends_on: set[int] | frozenset[int] = frozenset()) -> None:
        with self.lock:
            self.infos[info.step] = info
            self._depends[info.step] = set(depends_on)

    def forget(self, step: int) -> None:
        with self.lock:
            self.infos.pop(step, None)
            self._depends.pop(step, None)

    def remove(self, step: int) -> None:
        self._tier.remove(step)
        self.forget(step)


class UploadOrder:
    """Which jobs go first, and which queued ones a newer job supersedes, by the remote's retention policy
    (``None``: everything is kept, so nothing is superseded)."""

    def __init__(self, keep: RetentionPolicy | None, known: KnownRemote) -> None:
        self._keep = keep
        self._known = known

    def superseded(self, queue: list[SyncJob], active: SyncJob | None, others: Sequence[SyncJob] = ()) -> list[SyncJob]:
        """The queued jobs, except the newest, that the remote policy would not keep, and that no other un-synced
        job (queued, ``active`` or one of ``others``: failed, waiting) references."""
        if self._keep is None or len(queue) < 2:
            return []
        doomed = self.doomed(([active] if active else []) + queue)
        newest = max(j.step for j in queue)
        dropped = [j for j in queue if j.step in doomed and j.step != newest]
        return spared(dropped, [j for j in [*queue, *([active] if active else []), *others] if j not in dropped])

    def doomed(self, jobs: list[SyncJob]) -> set[int]:
        """Steps ``keep_remote`` would delete from what the remote holds plus ``jobs``."""
        if self._keep is None:
            return set()
        infos = sorted([*self._known.list(), *(j.info(self._known.location) for j in jobs)], key=lambda c: c.step)
        return {c.step for c in to_delete(infos, self._keep, context=RetentionContext(tier="remote", now=time.time()))}

    def ordered(self, jobs: list[SyncJob]) -> list[SyncJob]:
        """The newest first, then what the remote policy keeps for good (milestones), then the rest, each
        oldest first; a job after the jobs it references, whatever else."""
        jobs = sorted({j.step: j for j in jobs}.values(), key=lambda j: j.step)
        if not jobs:
            return []
        try:
            doomed = self.doomed(jobs)
        except Exception as e:  # a broken policy only costs the order; retention reports it itself
            log.warning("ordering the retries by keep_remote failed: %s", e)
            doomed = set()
        rest = jobs[:-1]
        return referenced_first([jobs[-1], *[j for j in rest if j.step not in doomed],
                                   *[j for j in rest if j.step in doomed]])
