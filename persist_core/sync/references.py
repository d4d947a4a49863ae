"""Uploads of incremental checkpoints (issue 43): what the upload queue does about references.

A checkpoint that another references (its manifest's ``depends_on()``) must be on the remote before the manifest of
the one referencing it goes up, and must stay there while that one does. So, in the queue
(:class:`~persist_core.sync.queue.UploadQueue`):

* a queued job that another un-synced job references is never superseded (:func:`spared`);
* a job goes after the queued jobs it references (:func:`referenced_first`);
* a job whose referenced checkpoints are neither on the remote nor queued gets them queued first, uploaded again from
  the local disk (:func:`missing`: the remote lost one, or a start-up backlog names only the dependent);
* an upload whose referenced checkpoints are still not on the remote fails before anything is written
  (:func:`check_on_remote`), and is retried after them;
* remote retention keeps what an un-synced job references (:func:`referenced_by`).

The functions are pure; :class:`References` reads the queue's state through the callables it is given (the queue
holds it, under its lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from persist_core.errors import RemoteError
from persist_core.format.manifest import Manifest
from persist_core.sync.job import SyncJob

__all__ = ["References", "check_on_remote", "referenced_first", "missing", "referenced_by", "spared"]


def _depends(job: SyncJob) -> set[int]:
    return job.manifest.depends_on()


def referenced_by(jobs: Iterable[SyncJob]) -> set[int]:
    """The steps any of ``jobs`` references."""
    return {step for job in jobs for step in _depends(job)}


def spared(dropped: list[SyncJob], others: list[SyncJob]) -> list[SyncJob]:
    """``dropped`` less every job that a job staying (one of ``others`` not dropped, or one of ``dropped`` spared)
    references, until none is left to spare."""
    gone = {j.step: j for j in dropped}
    everyone = [*others, *dropped]
    while True:
        needed = referenced_by(j for j in everyone if j.step not in gone) & set(gone)
        if not needed:
            return list(gone.values())
        for step in needed:
            del gone[step]


def referenced_first(jobs: list[SyncJob]) -> list[SyncJob]:
    """``jobs`` in the same order, except that each one comes after the jobs among them it references."""
    by_step = {j.step: j for j in jobs}
    out: list[SyncJob] = []
    placed: set[int] = set()

    def place(job: SyncJob, chain: frozenset[int]) -> None:
        if job.step in placed:
            return
        for step in sorted(_depends(job)):
            if step in by_step and step not in chain:  # a reference is always older: no cycle, but never loop
                place(by_step[step], chain | {job.step})
        placed.add(job.step)
        out.append(job)

    for job in jobs:
        place(job, frozenset())
    return out


def missing(jobs: list[SyncJob], on_remote: set[int], local_job: Callable[[int], SyncJob | None]) -> list[SyncJob]:
    """Jobs for the steps ``jobs`` reference that neither the remote nor ``jobs`` hold: ``local_job(step)`` makes one
    from the local disk (``None``: not there either; the dependent's upload then fails, naming it)."""
    queued = {j.step for j in jobs}
    found: dict[int, SyncJob] = {}
    for step in sorted(referenced_by(jobs) - on_remote - queued):
        job = local_job(step)
        if job is not None:
            found[step] = job
    return list(found.values())


def check_on_remote(job: SyncJob, on_remote: set[int], url: str) -> None:
    """Raise unless every checkpoint ``job`` references is on the remote (its manifest must not go up before them).

    Raises:
        RemoteError: names the steps missing there (the upload is retried once they are uploaded).
    """
    lacking = _depends(job) - on_remote
    if lacking:
        raise RemoteError(f"checkpoint step={job.step} references step(s) {sorted(lacking)}, which {url} does not hold "
                          "yet; it is uploaded after them (they are kept locally until then)")


class _Known(Protocol):
    """The remote as the sync thread knows it (:class:`~persist_core.sync.order.KnownRemote`)."""

    listed: bool

    def steps(self) -> set[int]: ...


class References:
    """What references ask of the upload queue, over its state (any thread; :meth:`lacking` with its lock held).

    Args:
        known: the remote as the sync thread knows it.
        unsynced: the queue's jobs not uploaded yet (queued, uploading, failed, waiting), by step.
        local_job: a job for committed local checkpoint ``step``, or ``None`` when it is not there.
        abandoned: the local set-aside checkpoints as ``(step, at, manifest, name)`` (their remote copies are set
            aside too: what they reference stays).
    """

    def __init__(self, known: _Known, unsynced: Callable[[], dict[int, SyncJob]],
                 local_job: Callable[[int], SyncJob | None],
                 abandoned: Callable[[], list[tuple[int, int, Manifest, str]]] | None = None) -> None:
        self._known = known
        self._unsynced = unsynced
        self._local_job = local_job
        self._abandoned = abandoned

    def kept_remotely(self) -> set[int]:
        """What remote retention keeps whatever its policy says: what the jobs not on the remote yet reference (for
        those there, the remote manifests say), and what a set-aside branch references (its remote copy, like its
        local one, still needs those bytes)."""
        there = self._known.steps()
        aside = {ref for _, _, m, _ in (self._abandoned() if self._abandoned is not None else []) for ref in
                 m.depends_on()}
        return aside | referenced_by(j for j in self._unsynced().values() if j.step not in there)

    def lacking(self, jobs: list[SyncJob]) -> list[SyncJob]:
        """Jobs for what ``jobs`` reference that the remote lacks and nothing un-synced holds (:func:`missing`);
        none before the remote is listed (the start-up listing looks then)."""
        if not self._known.listed:
            return []
        return missing(jobs, self._known.steps() | set(self._unsynced()), self._local_job)
