"""The remote copy of a checkpoint written on several nodes: every rank uploads its own files, rank 0
the manifest after all of them.

With node-local ``local_dir`` s no process sees every file, so rank 0's upload queue
(:class:`~persist_core.sync.queue.UploadQueue`) drives the others over a process group of their own (the
collectives' ``uploads`` channel: neither the commit's nor the training thread's). Per checkpoint,
on the sync thread of rank 0 and the :class:`Follower` thread of every other rank::

    rank 0        broadcast ("upload", step, what is un-synced)
    every rank    upload its own files of step from its node's local_dir   -> all_gather (ok, or the error)
    rank 0        all ok: upload its own files, then the manifest (the copy that holds every file)
                  broadcast ("done", uploaded?, what is un-synced now)

A rank's failure fails the upload on rank 0 (retried later like any failed upload); no manifest is
uploaded, so the remote prefix is still no checkpoint. What rank 0 says is un-synced is what each
node's local retention must keep (:meth:`Follower.protected`): every node deletes the same steps, and
none deletes one whose upload has not committed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from persist_core.distributed import Collectives
from persist_core.errors import RemoteError
from persist_core.tiers.local import checkpoint_dir, committed_steps, read_manifest
from persist_core.tiers.remote import RemoteTier

log = logging.getLogger(__name__)


def uploads_channel(coll: Collectives) -> Collectives | None:
    """The collectives the sync threads use to assemble a remote copy (``None`` when ``coll`` has none)."""
    return getattr(coll, "uploads", None)


class Coordinator:
    """Rank 0's side, called by its sync thread around each upload.

    Args:
        coll: the uploads channel.
        unsynced: rank 0's un-synced steps (what every node must keep).
    """

    def __init__(self, coll: Collectives, unsynced: Callable[[], set[int]]) -> None:
        self._coll = coll
        self._unsynced = unsynced
        self._stopped = False

    def before(self, step: int) -> None:
        """Have every other rank upload its files of ``step``; raises if any could not.

        Raises:
            RemoteError: naming the ranks that failed (the ``done`` message is sent already).
        """
        self._coll.broadcast(("upload", step, sorted(self._unsynced())))
        results = self._coll.all_gather(None)
        failures = [f"rank {r}: {e}" for r, e in enumerate(results) if e]
        if failures:
            self.after(step, uploaded=False)
            raise RemoteError(f"checkpoint step={step} is not uploaded: other ranks could not upload their files "
                              f"({'; '.join(failures[:4])}); the manifest waits, and the upload is retried")

    def after(self, step: int, *, uploaded: bool) -> None:
        """Tell every rank how the upload of ``step`` ended (once per :meth:`before`)."""
        self._coll.broadcast(("done", step, uploaded, sorted(self._unsynced())))

    def stop(self) -> None:
        """End the followers' threads (rank 0's close, once its sync thread has stopped)."""
        if not self._stopped:
            self._stopped = True
            self._coll.broadcast(("stop",))


class Follower:
    """Every other rank's side: a thread that uploads this rank's files when rank 0 says, and knows
    what rank 0 has not uploaded yet (for this node's retention).

    Args:
        root: this node's ``local_dir``.
        coll: the uploads channel.
        tier: the remote tier.
        after_round: called after each upload round ends (this node's local retention); may raise.
    """

    def __init__(self, root: Path, coll: Collectives, tier: RemoteTier, after_round: Callable[[], None]) -> None:
        self._root = root
        self._coll = coll
        self._tier = tier
        self._after_round = after_round
        self._lock = threading.Lock()
        self._heard = False
        self._unsynced: set[int] = set()
        self._upto = -1  # the newest step committed here when rank 0 last spoke
        self._thread = threading.Thread(target=self._run, name="persist-upload-follower", daemon=True)
        self._thread.start()

    def protected(self) -> set[int]:
        """Steps this node must keep: rank 0's un-synced ones, and every step it has not heard about
        (all of them until rank 0 first speaks)."""
        steps = set(committed_steps(self._root))
        with self._lock:
            if not self._heard:
                return steps
            return (self._unsynced & steps) | {s for s in steps if s > self._upto}

    def close(self, timeout_s: float) -> None:
        """Wait for rank 0's ``stop`` (it comes once rank 0's uploads are done), at most ``timeout_s``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("[rank=%d] rank 0 did not end the upload rounds within %.0f s; closing without it",
                      self._coll.rank, timeout_s)

    def _hear(self, unsynced: list[int]) -> None:
        newest = max(committed_steps(self._root), default=-1)
        with self._lock:
            self._heard, self._unsynced, self._upto = True, set(unsynced), newest

    def _run(self) -> None:
        while True:
            try:
                message: Any = self._coll.broadcast(None)
            except Exception as e:  # rank 0 is gone (or the group was torn down): no more rounds
                log.warning("[rank=%d] the upload rounds ended: %s: %s", self._coll.rank, type(e).__name__, e)
                return
            if message[0] == "stop":
                return
            _, step, unsynced = message
            self._hear(unsynced)
            error = self._upload_mine(step)
            try:
                self._coll.all_gather(error)
                _, _, _, unsynced = self._coll.broadcast(None)
            except Exception as e:
                log.warning("[rank=%d] the upload rounds ended: %s: %s", self._coll.rank, type(e).__name__, e)
                return
            self._hear(unsynced)
            try:
                self._after_round()
            except Exception as e:  # retention's own failure: logged, the next round tries again
                log.error("[rank=%d] local retention after the upload of step=%d failed: %s", self._coll.rank, step, e)

    def _upload_mine(self, step: int) -> str | None:
        """Upload this rank's files of ``step``; ``None``, or what went wrong."""
        ckpt = checkpoint_dir(self._root, step)
        try:
            manifest = read_manifest(ckpt)
            mine = tuple(f for f in manifest.held() if f.rank == self._coll.rank)
            self._tier.upload_files(ckpt, step, mine)
        except Exception as e:
            log.warning("[rank=%d][step=%d] uploading this rank's files failed: %s", self._coll.rank, step, e)
            return f"{type(e).__name__}: {e}"
        return None
