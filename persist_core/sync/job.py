"""One upload job (:class:`SyncJob`: a committed local checkpoint and the handle whose remote phase it ends),
and how a job ends without an upload (:func:`end_superseded`) or with a failure (:func:`explain`).
"""

from __future__ import annotations

import logging
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
