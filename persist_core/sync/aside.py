"""The remote's side of a branch (:class:`RemoteAside`): at once, the remote's newer checkpoints leave the live
branch (:meth:`RemoteAside.hide`, on the caller's thread); on the sync thread before each upload, they are moved
under their abandoned names (:meth:`RemoteAside.apply`). The two halves are :mod:`persist_core.tiers.remote_aside`'s.

The local side is :class:`~persist_core.timeline.Timeline`: it sets the local checkpoints aside at once and
tells the upload queue (:meth:`~persist_core.sync.queue.UploadQueue.start_branch`), which tells this.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from persist_core.errors import CorruptCheckpointError, RemoteError
from persist_core.format.manifest import Manifest
from persist_core.sync.lease import RemoteLease
from persist_core.sync.order import KnownRemote
from persist_core.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

#: how long a branch waits on the training thread for the sync thread to take the remote's newer checkpoints off the
#: live branch (their manifests; the rest of the move follows before the next upload)
BRANCH_WAIT_S = 10.0


class RemoteAside:
    """The remote's side of a branch, on the sync thread before each upload (:meth:`apply`): the remote's
    checkpoints newer than the branch point are set aside (:meth:`branch` says where it is); once after the
    listing, so are the remote copies of what an earlier run set aside locally but died before the remote
    followed (``abandoned``: the local set-aside checkpoints as ``(step, at, manifest, name)``).
    """

    def __init__(self, tier: RemoteTier, known: KnownRemote,
                 abandoned: Callable[[], list[tuple[int, int, Manifest, str]]] | None) -> None:
        self._tier = tier
        self._known = known
        self._abandoned = abandoned
        self._unmoved: list[tuple[int, int, Manifest, str]] = []
        self._lock = threading.Lock()
        self._at: int | None = None
        self._hidden: list[tuple[int, int]] = []  # (step, at) taken off the live branch, their move to finish
        self._ask: int | None = None  # a branch point whose newer checkpoints leave the live branch now (ask_hide)
        self._answered = threading.Event()  # ... and they did, or could not (said)

    def ask_hide(self, at: int) -> None:
        """The training thread, at a branch: ask the sync thread to :meth:`hide` now (the queue's condition held)."""
        self._ask = at
        self._answered.clear()

    @property
    def asked(self) -> bool:
        return self._ask is not None

    def wait_hidden(self, at: int) -> None:
        """The training thread: wait, at most :data:`BRANCH_WAIT_S`, for the sync thread to answer :meth:`ask_hide`
        (it may be in the middle of an upload: then the move follows it, said)."""
        if not self._answered.wait(BRANCH_WAIT_S):
            log.warning("the upload to %s under way holds the sync thread: the remote's checkpoints newer than step "
                        "%d leave the live branch once it is done (a fresh machine may resume them until then)",
                        self._tier.url, at)

    def hide_asked(self, lease: RemoteLease | None) -> None:
        """The sync thread: :meth:`hide` what was asked, where this run may write to the remote (its lease); when it
        may not, or the remote does not answer, the whole move waits for the next upload (said)."""
        at, self._ask = self._ask, None
        try:
            if at is None:
                return
            if lease is not None:
                lease.ensure()
            self.hide(at)
        except Exception as e:
            log.warning("the remote %s's checkpoints newer than step %s leave the live branch before the next upload "
                        "(now: %s)", self._tier.url, at, e)
        finally:
            self._answered.set()

    def hide(self, at: int) -> None:
        """A run resumed from ``at`` saves past it (the sync thread, as soon as it is free after the local checkpoints
        were set aside): the remote's newer checkpoints leave the live branch now, so a run killed before its next
        upload leaves the remote as its local restart sees it. Not listed yet (an outage), nothing: they move before
        the next upload, as the rest of the move does.

        Raises:
            RemoteError / OSError: the remote did not answer (what is hidden stays hidden; the rest moves later).
        """
        if not self._known.listed:
            raise RemoteError(f"{self._tier.url} is not listed yet")
        for step in sorted(s for s in self._known.steps() if s > at):
            self._tier.hide(step, at)
            with self._lock:
                self._hidden.append((step, at))

    def branch(self, at: int) -> None:
        """A run resumed from ``at`` saves past it (any thread)."""
        with self._lock:
            self._at = at

    def listed(self) -> None:
        """The remote was listed: what an earlier run set aside locally is compared with it at the next
        :meth:`apply`, and what it took off the live branch without moving it is moved then."""
        self._unmoved = self._abandoned() if self._abandoned is not None else []
        hidden = self._tier.hidden()
        with self._lock:
            self._hidden += [h for h in hidden if h not in self._hidden]

    def apply(self) -> None:
        """Set aside what the branch and the earlier runs ask for (raises to retry at the next upload)."""
        with self._lock:
            at = self._at
        if at is not None:
            for info in [i for i in self._known.list() if i.step > at]:
                self._tier.set_aside(info.step, at)
                self._known.forget(info.step)
            with self._lock:
                if self._at == at:
                    self._at = None
        with self._lock:
            pending = list(self._hidden)
        if pending:  # taken off the live branch (by this run or a killed one), their move not finished
            still = set(self._tier.hidden())
            for step, at in pending:
                if (step, at) in still:
                    self._tier.set_aside(step, at)
                    self._known.forget(step)
                with self._lock:
                    self._hidden.remove((step, at))
        while self._unmoved:
            step, at, manifest, _ = self._unmoved[0]
            try:
                same = step in self._known.steps() and self._tier.read_manifest(step) == manifest
            except CorruptCheckpointError:
                same = False
            if same:
                log.info("[step=%d] setting aside on %s what an earlier run set aside locally", step, self._tier.url)
                self._tier.set_aside(step, at)
                self._known.forget(step)
            self._unmoved.pop(0)
