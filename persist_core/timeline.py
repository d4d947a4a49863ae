"""The timeline of one ``local_dir``: saves go forward, except after a resume from an older step,
which starts a new branch and sets the old branch's newer checkpoints aside on both tiers.

The engine asks :meth:`Timeline.check` before every save (caller's thread). Setting aside is one
durable rename per local checkpoint (:meth:`LocalTier.set_aside`), done at once, and a request to
the upload queue (:meth:`RemoteSync.start_branch`), which moves the remote's newer checkpoints
before its next upload. Set-aside checkpoints are kept, listed as abandoned, never pruned and never
the latest: retention and ``load()`` see only the live branch.
"""

from __future__ import annotations

from pathlib import Path

from persist_core.errors import ConfigError
from persist_core.sync import RemoteSync
from persist_core.tiers.local import LocalTier


class Timeline:
    """Which steps may be saved next in ``root`` (and on the remote ``sync`` uploads to).

    Args:
        root: ``local_dir``.
        local: its tier.
        sync: the upload queue, or ``None`` (no remote, or not rank 0).
        leader: this rank sets aside (rank 0); the others only agree.
    """

    def __init__(self, root: Path, local: LocalTier, sync: RemoteSync | None, *, leader: bool) -> None:
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
