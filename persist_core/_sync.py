"""The remote sync queue: one thread uploading committed local checkpoints, oldest first.

The engine calls :meth:`RemoteSync.submit` after each local commit and :meth:`RemoteSync.drain`
from ``wait()``; the sync thread calls the engine's ``on_done`` once per job (uploaded,
superseded or failed). Back-pressure: when a new job arrives, queued jobs that have not started
and that the remote retention policy would not keep are superseded by it. Milestones (kept by
the policy) are never superseded; with no remote policy, every checkpoint is kept, so none is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from persist_core.manifest import Manifest
from persist_core.remote import RemoteTier
from persist_core.restore import CheckpointInfo
from persist_core.retention import RetentionContext, RetentionPolicy, to_delete

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncJob:
    """One committed local checkpoint to upload."""

    local_ckpt: Path
    manifest: Manifest
    committed_at: float  # time.monotonic() of the local commit

    @property
    def step(self) -> int:
        return self.manifest.step

    def info(self, url: str) -> CheckpointInfo:
        return CheckpointInfo(step=self.step, time=self.manifest.time, nbytes=self.manifest.nbytes,
                              path=f"{url}/{self.local_ckpt.name}", tier="remote")


#: ``on_done(job, outcome, error, upload_s)``: outcome is "uploaded", "superseded" or "failed".
OnDone = Callable[[SyncJob, str, "BaseException | None", float], None]


class RemoteSync:
    """Uploads jobs in step order on one thread, then applies ``keep_remote`` on the remote."""

    def __init__(self, tier: RemoteTier, *, keep_remote: RetentionPolicy | None, on_done: OnDone) -> None:
        self._tier = tier
        self._keep = keep_remote
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: list[SyncJob] = []
        self._active: SyncJob | None = None
        self._stopping = False
        self._retention_lock = threading.Lock()
        self._remote: dict[int, CheckpointInfo] = {i.step: i for i in tier.list()}
        self._thread = threading.Thread(target=self._run, name="persist-sync", daemon=False)
        self._thread.start()
        # At interpreter exit (an engine never closed), finish the queued uploads, then stop,
        # like concurrent.futures' workers do; otherwise the process would never exit.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._stop)

    def remote_steps(self) -> set[int]:
        with self._cond:
            return set(self._remote)

    def unsynced_steps(self) -> set[int]:
        """Steps queued or uploading: local retention must keep them."""
        with self._cond:
            return {j.step for j in self._queue} | ({self._active.step} if self._active else set())

    def submit(self, job: SyncJob) -> None:
        with self._cond:
            self._queue.append(job)
            self._queue.sort(key=lambda j: j.step)
            superseded = self._supersede()
            self._cond.notify_all()
        for old in superseded:
            log.info("[step=%d] upload superseded by a newer checkpoint (remote is behind)", old.step)
            self._on_done(old, "superseded", None, 0.0)

    def _supersede(self) -> list[SyncJob]:
        """Drop queued jobs, except the newest, that the remote policy would not keep (lock held)."""
        if self._keep is None or len(self._queue) < 2:
            return []
        pending = ([self._active] if self._active else []) + self._queue
        infos = sorted([*self._remote.values(), *(j.info(self._tier.url) for j in pending)], key=lambda c: c.step)
        context = RetentionContext(tier="remote", now=time.time())
        doomed = {c.step for c in to_delete(infos, self._keep, context=context)}
        newest = self._queue[-1].step
        dropped = [j for j in self._queue if j.step in doomed and j.step != newest]
        self._queue = [j for j in self._queue if j not in dropped]
        return dropped

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or uploading; ``False`` if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._active is None, timeout)

    def close(self) -> None:
        """Finish every queued upload, then stop the thread."""
        self._stop()
        self._thread.join()

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                job = self._active = self._queue.pop(0)
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                self._tier.upload(job.local_ckpt, job.manifest)
            except BaseException as e:  # reported through on_done, raised once by the engine
                error = e
            upload_s = time.perf_counter() - t0
            if error is None:
                with self._cond:
                    self._remote[job.step] = job.info(self._tier.url)
                try:
                    self.apply_retention()
                except BaseException as e:
                    error = e
            self._on_done(job, "failed" if error and job.step not in self._remote else "uploaded", error, upload_s)
            with self._cond:  # only now, so drain() returns after on_done has recorded the outcome
                self._active = None
                self._cond.notify_all()

    def apply_retention(self) -> None:
        """Apply ``keep_remote`` to the remote now (the sync thread also does after each upload)."""
        if self._keep is None:
            return
        with self._retention_lock:
            self._apply_retention()

    def _apply_retention(self) -> None:
        if self._keep is None:
            return
        with self._cond:
            infos = list(self._remote.values())
            protected = {j.step for j in self._queue}
        for info in to_delete(infos, self._keep, context=RetentionContext(tier="remote", now=time.time()),
                              protected=protected):
            log.info("[step=%d] remote retention (%r) removes %s", info.step, self._keep, info.path)
            self._tier.remove(info.step)
            with self._cond:
                self._remote.pop(info.step, None)
