"""The timeline of one ``local_dir``: saves go forward, except after a resume from an older step,
which starts a new branch and sets the old branch's newer checkpoints aside on both tiers.

The engine asks :meth:`Timeline.check` before every save (caller's thread). Setting aside is one
durable rename per local checkpoint (:meth:`LocalTier.set_aside`), done at once, and a request to
the upload queue (:meth:`RemoteSync.start_branch`), whose :class:`RemoteAside` moves the remote's newer
checkpoints before its next upload (sync thread). Set-aside checkpoints are kept, listed as abandoned,
never pruned and never the latest: retention and ``load()`` see only the live branch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.tiers.local import LocalTier

if TYPE_CHECKING:
    from persist_core.tiers.remote import RemoteTier
    from persist_core.uploads import KnownRemote

log = logging.getLogger(__name__)


class Uploads(Protocol):
    """What the timeline needs of the upload queue (:class:`~persist_core.sync.RemoteSync`)."""

    def known_steps(self) -> set[int]: ...

    def start_branch(self, at: int) -> None: ...


class Timeline:
    """Which steps may be saved next in ``root`` (and on the remote ``sync`` uploads to).

    Args:
        root: ``local_dir``.
        local: its tier.
        sync: the upload queue, or ``None`` (no remote, or not rank 0).
        leader: this rank sets aside (rank 0); the others only agree.
    """

    def __init__(self, root: Path, local: LocalTier, sync: Uploads | None, *, leader: bool) -> None:
        self._root = root
        self._local = local
        self._sync = sync
        self._leader = leader
        self._newest: int | None = None  # the newest step committed or saved on the live branch

    def check(self, step: int, resumed_at: int | None) -> None:
        """Refuse a save older than the newest committed, unless the run resumed from an older step.

        The first save at or past ``resumed_at`` with newer checkpoints committed starts a branch: they are
        set aside here at once and on the remote before the next upload.

        Raises:
            ConfigError: ``step`` is older than the newest committed checkpoint and no resume explains it.
        """
        if self._newest is None:  # once: what is committed here (and on the remote, if it was listed)
            remote = self._sync.known_steps() if self._sync is not None else set()
            self._newest = max([*self._local.committed_steps(), *remote], default=-1)
        if resumed_at is not None and resumed_at <= step <= self._newest and not step == resumed_at == self._newest:
            if self._leader:
                for newer in [s for s in self._local.committed_steps() if s > resumed_at]:
                    self._local.set_aside(newer, resumed_at)
                if self._sync is not None:
                    self._sync.start_branch(resumed_at)
            self._newest = step
            return
        if step >= self._newest:
            self._newest = step
            return
        raise ConfigError(
            f"step={step} is older than the newest committed checkpoint ({self._newest}) in {self._root}: saving it "
            "would make a timeline where retention deletes it and resuming returns the newer one. To go back on "
            "purpose, load the older checkpoint first (engine.load(step), or the adapters' fit(ckpt_path=...) / "
            "load_state(...)): the next save starts a new branch and sets the newer ones aside; otherwise save a "
            f"step after {self._newest}")


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
