"""The upload queue's outages (:class:`Outage`): the uploads that failed, kept un-synced and retried on a backoff
timer, and whether the remote is down now (its recovery said once).

Who calls what: :class:`~persist_core.sync.queue.UploadQueue` only, its lock held for every call (the sync thread
after each attempt or listing; ``drain`` and ``close`` on the training thread).
"""

from __future__ import annotations

import logging

from persist_core.sync.job import SyncJob

log = logging.getLogger(__name__)

#: the longest wait between two retries (the wait doubles from the tier's backoff after each failure)
MAX_RETRY_S = 60.0


class Outage:
    """Failed uploads and the retry timer.

    Args:
        url: the remote (in messages).
        backoff_s: the first wait before a retry (the tier's).
    """

    def __init__(self, url: str, backoff_s: float) -> None:
        self._url, self._backoff_s = url, backoff_s
        self.failed: dict[int, SyncJob] = {}  # uploads that failed, by step: retried, protected meanwhile
        self.retry_s = backoff_s  # the wait before the next retry
        self.retry_now = False  # drain() asked for a retry at once
        self.down = False  # the last listing or upload failed (its recovery is said once)
        self.failures = 0  # failed attempts (uploads and listings), all told

    def due(self) -> bool:
        """A retry is asked for now (``drain``)."""
        return bool(self.failed) and self.retry_now

    def wait_s(self) -> float | None:
        """How long the sync thread sleeps before a retry (``None``: nothing to retry)."""
        return self.retry_s if self.failed else None

    def listing_failed(self) -> None:
        """The remote could not be listed: counted like a failed upload (``summary()["upload_failures"]``)."""
        self.failures += 1
        self.down = True

    def upload_failed(self, job: SyncJob, *, vanished: bool) -> None:
        """``job``'s upload failed: kept for a retry, the timer doubled; ``vanished``: its local copy is gone, nothing
        to retry."""
        self.failures += 1
        if vanished:
            return
        self.failed[job.step] = job
        self.down = True
        self.retry_s = min(self.retry_s * 2, MAX_RETRY_S)

    def uploaded(self) -> None:
        """An upload succeeded: the timer starts over; a remote that was down is back (said once)."""
        self.retry_s = self._backoff_s
        if self.down:
            self.down = False
            log.warning("%s is reachable again (after %d failed attempts); uploading what waited", self._url,
                        self.failures)

    def drop_after(self, at: int) -> list[SyncJob]:
        """The failed uploads of steps past ``at`` (a branch set them aside locally), no longer kept here."""
        dropped = [j for s, j in self.failed.items() if s > at]
        for job in dropped:
            del self.failed[job.step]
        return dropped

    def take(self) -> list[SyncJob]:
        """The failed uploads, to queue again (none kept here any more)."""
        self.retry_now = False
        jobs = list(self.failed.values())
        self.failed.clear()
        return jobs
