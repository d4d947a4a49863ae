"""One upload job (:class:`SyncJob`: a committed local checkpoint and the handle whose remote phase it ends),
how a job ends without an upload (:func:`end_superseded`, :func:`not_uploaded_at_close`) or with a failure
(:func:`explain`), and how far behind jobs leave the remote (:func:`behind`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from persist_core.errors import DirectoryInUseError, PersistError, RemoteError
from persist_core.format.manifest import Manifest
from persist_core.handle import SaveHandle
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

    def uploaded(self, upload_s: float, *, latest_step: int) -> None:
        """Its upload took ``upload_s``: the handle's upload figures (the lag counts from the local commit, and in
        steps from ``latest_step``, the newest saved)."""
        self.handle._update(upload_s=upload_s, lag_s=time.monotonic() - self.committed_at,
                            upload_gbps=self.manifest.nbytes / upload_s / 1e9 if upload_s > 0 else None,
                            lag_steps=max(0, latest_step - self.step))

    def info(self, url: str) -> CheckpointInfo:
        return CheckpointInfo(step=self.step, time=self.manifest.time, nbytes=self.manifest.nbytes,
                              path=f"{url}/{self.local_ckpt.name}", tier="remote")


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


def behind(jobs: list[SyncJob], failures: int) -> dict[str, float | int | None]:
    """How far behind the remote is, for a summary: un-synced ``jobs``, their bytes, the oldest one's age (s)."""
    oldest = min((j.committed_at for j in jobs), default=None)
    return {"remote_behind_steps": len(jobs), "remote_behind_bytes": sum(j.manifest.nbytes for j in jobs),
            "oldest_unsynced_age_s": None if oldest is None else time.monotonic() - oldest, "upload_failures": failures}


def not_uploaded_at_close(job: SyncJob, url: str) -> RemoteError:
    """What the handle of a job that ``close()`` gave up on says."""
    return RemoteError(f"checkpoint step={job.step} was not uploaded to {url} before the engine closed (the remote did "
                       "not answer within remote_timeout_s); it stays committed locally and the next engine on this "
                       "directory uploads it")
