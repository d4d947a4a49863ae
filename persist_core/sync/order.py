"""What the upload queue works with: one job, the remote as the sync thread knows it, the order jobs go in,
and how an upload that failed is said.

:class:`~persist_core.sync.queue.RemoteSync` (the queue and its thread) holds the state; the pieces here hold none
of it: :class:`UploadOrder` answers which queued jobs the remote policy would drop and in what order retries
go, :func:`explain` turns what an upload raised into the error its handle reports.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from persist_core.errors import DirectoryInUseError, PersistError, RemoteError
from persist_core.format.manifest import Manifest
from persist_core.handle import SaveHandle
from persist_core.policies.retention import RetentionContext, RetentionPolicy, to_delete
from persist_core.tiers.remote import RemoteTier
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncJob:
    """One committed local checkpoint to upload, and the handle whose remote phase it ends."""

    local_ckpt: Path
    manifest: Manifest
    handle: SaveHandle
    committed_at: float  # time.monotonic() of the local commit

    @property
    def step(self) -> int:
        return self.manifest.step

    def info(self, url: str) -> CheckpointInfo:
        return CheckpointInfo(step=self.step, time=self.manifest.time, nbytes=self.manifest.nbytes,
                              path=f"{url}/{self.local_ckpt.name}", tier="remote")


class KnownRemote:
    """The remote as the sync thread knows it (listed once, then kept up to date): a Tier for retention."""

    kind = "remote"

    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier
        self.infos: dict[int, CheckpointInfo] = {}
        self.lock = threading.Lock()

    @property
    def location(self) -> str:
        return self._tier.url

    def list(self) -> list[CheckpointInfo]:
        with self.lock:
            return sorted(self.infos.values(), key=lambda c: c.step)

    def steps(self) -> set[int]:
        with self.lock:
            return set(self.infos)

    def reset(self, infos: list[CheckpointInfo]) -> None:
        with self.lock:
            self.infos = {i.step: i for i in infos}

    def add(self, info: CheckpointInfo) -> None:
        with self.lock:
            self.infos[info.step] = info

    def forget(self, step: int) -> None:
        with self.lock:
            self.infos.pop(step, None)

    def remove(self, step: int) -> None:
        self._tier.remove(step)
        self.forget(step)


class UploadOrder:
    """Which jobs go first, and which queued ones a newer job supersedes, by the remote's retention policy
    (``None``: everything is kept, so nothing is superseded)."""

    def __init__(self, keep: RetentionPolicy | None, known: KnownRemote) -> None:
        self._keep = keep
        self._known = known

    def superseded(self, queue: list[SyncJob], active: SyncJob | None) -> list[SyncJob]:
        """The queued jobs, except the newest, that the remote policy would not keep."""
        if self._keep is None or len(queue) < 2:
            return []
        doomed = self.doomed(([active] if active else []) + queue)
        newest = max(j.step for j in queue)
        return [j for j in queue if j.step in doomed and j.step != newest]

    def doomed(self, jobs: list[SyncJob]) -> set[int]:
        """Steps ``keep_remote`` would delete from what the remote holds plus ``jobs``."""
        if self._keep is None:
            return set()
        infos = sorted([*self._known.list(), *(j.info(self._known.location) for j in jobs)], key=lambda c: c.step)
        return {c.step for c in to_delete(infos, self._keep, context=RetentionContext(tier="remote", now=time.time()))}

    def ordered(self, jobs: list[SyncJob]) -> list[SyncJob]:
        """The newest first, then what the remote policy keeps for good (milestones), then the rest, each
        oldest first."""
        jobs = sorted({j.step: j for j in jobs}.values(), key=lambda j: j.step)
        if not jobs:
            return []
        try:
            doomed = self.doomed(jobs)
        except Exception as e:  # a broken policy only costs the order; retention reports it itself
            log.warning("ordering the retries by keep_remote failed: %s", e)
            doomed = set()
        rest = jobs[:-1]
        return [jobs[-1], *[j for j in rest if j.step not in doomed], *[j for j in rest if j.step in doomed]]


def explain(error: BaseException, job: SyncJob, tier: RemoteTier, *, uploaded: bool) -> BaseException:
    """The error ``job``'s handle reports for what its upload (or the retention after it) raised."""
    if isinstance(error, DirectoryInUseError):
        return error  # says it all: the holder and the fix
    if not uploaded and (hint := tier.hint(error)):
        return wrapped(f"uploading checkpoint step={job.step} to {tier.url} failed{hint}", error)
    if uploaded:
        return wrapped(f"checkpoint step={job.step} was uploaded, but the retention that follows failed", error)
    return error


def end_superseded(jobs: list[SyncJob], why: str) -> None:
    """End the remote phase of jobs that will not be uploaded by this engine (each handle says so)."""
    for job in jobs:
        log.info("[step=%d] %s", job.step, why)
        job.handle._update(superseded=True)
        job.handle._set_remote_done()


def wrapped(message: str, error: BaseException) -> BaseException:
    kind = RemoteError if isinstance(error, RemoteError) else PersistError
    out = kind(f"{message}: {type(error).__name__}: {error}")
    out.__cause__ = error
    return out
