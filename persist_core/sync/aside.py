"""The remote's side of a branch (:class:`RemoteAside`), on the sync thread before each upload.

The local side is :class:`~persist_core.timeline.Timeline`: it sets the local checkpoints aside at once and
tells the upload queue (:meth:`~persist_core.sync.queue.RemoteSync.start_branch`), which tells this.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from persist_core.errors import CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.sync.order import KnownRemote
from persist_core.tiers.remote import RemoteTier

log = logging.getLogger(__name__)


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

    def branch(self, at: int) -> None:
        """A run resumed from ``at`` saves past it (any thread)."""
        with self._lock:
            self._at = at

    def listed(self) -> None:
        """The remote was listed: what an earlier run set aside locally is compared with it at the next
        :meth:`apply`."""
        self._unmoved = self._abandoned() if self._abandoned is not None else []

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
