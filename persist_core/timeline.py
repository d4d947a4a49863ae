"""The timeline of one ``local_dir``: saves go forward, except after a resume from an older step,
which starts a new branch and sets the old branch's newer checkpoints aside on both tiers.

Whose timeline the remote holds is settled at the first save: a run that loaded nothing may not write
beside another run's committed checkpoints (it would replace or mix with them). The remote's start-up
listing decides; the save is refused, or, with ``start_over=True``, every committed checkpoint of both tiers
is set aside (branch point :data:`~persist_core.layout.START`). When the remote cannot be listed in time (an
outage) the saves go on locally and the upload queue decides once it lists it: nothing of this run is
uploaded beside another run's checkpoints.

The engine asks :meth:`Timeline.check` before every save (caller's thread). Setting aside is one
durable rename per local checkpoint (:meth:`LocalTier.set_aside`), done at once, and a request to
the upload queue (:meth:`UploadQueue.start_branch`), whose :class:`~persist_core.sync.aside.RemoteAside`
moves the remote's newer checkpoints before its next upload (sync thread). Set-aside checkpoints are kept, listed as abandoned,
never pruned and never the latest: retention and ``load()`` see only the live branch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from persist_core.errors import ConfigError
from persist_core.layout import START
from persist_core.tiers.local import LocalTier


class Uploads(Protocol):
    """What the timeline needs of the upload queue (:class:`~persist_core.sync.queue.UploadQueue`)."""

    def known_steps(self) -> set[int]: ...

    def start_branch(self, at: int) -> None: ...

    def wait_listed(self, timeout: float) -> set[int] | None: ...

    def fresh_run(self, refusal: Callable[[set[int]], Exception]) -> None: ...


#: ``agree(refusal)``: rank 0's verdict on every rank (a broadcast on the decisions channel; one process: itself)
Agree = Callable[["str | None"], "str | None"]


class Timeline:
    """Which steps may be saved next in ``root`` (and on the remote ``sync`` uploads to).

    Args:
        root: ``local_dir``.
        local: its tier.
        sync: the upload queue, or ``None`` (no remote, or not rank 0).
        leader: this rank sets aside (rank 0); the others only agree.
        url: the remote's URL (for messages), or ``None``.
        start_over: a run that loads nothing sets every committed checkpoint of both tiers aside.
        listing_timeout_s: how long the first save waits for the remote's start-up listing.
        agree: rank 0's refusal, on every rank.
    """

    def __init__(self, root: Path, local: LocalTier, sync: Uploads | None, *, leader: bool, url: str | None = None,
                 start_over: bool = False, listing_timeout_s: float = 300.0,
                 agree: Agree = lambda refusal: refusal) -> None:
        self._root = root
        self._local = local
        self._sync = sync
        self._leader = leader
        self._url = url
        self._start_over = start_over
        self._listing_timeout_s = listing_timeout_s
        self._agree = agree
        self._newest: int | None = None  # the newest step committed or saved on the live branch
        self._settled: int | None = None  # the step resumed from whose branch (or none) is decided

    def resumed(self) -> None:
        """This run (again) continues from a committed step: the first check at or past it decides whether that
        resume starts a branch (the newer checkpoints committed then are set aside), and no later check does."""
        self._settled = None
        self._newest = None  # what is committed is listed again (a resume within one engine)

    def check(self, step: int, resumed_at: int | None) -> None:
        """Refuse a save older than the newest committed, unless the run resumed from an older step.

        The first save or snapshot at or past ``resumed_at`` decides, once per resume (:meth:`resumed`): with
        newer checkpoints committed it starts a branch, and they are set aside here at once and on the remote
        before the next upload; every later step of this run, snapshot or save, is the live branch.

        Raises:
            ConfigError: ``step`` is older than the newest committed checkpoint and no resume explains it.
        """
        if self._newest is None:  # once: whose timeline this is, then what is committed here and on the remote
            started_over = self._settle(resumed_at)
            remote = self._sync.known_steps() if self._sync is not None and not started_over else set()
            self._newest = max([*self._local.committed_steps(), *remote], default=-1)
        if resumed_at is not None and resumed_at != self._settled and step >= resumed_at:
            self._settled = resumed_at  # decided once: a snapshot and a save of one step never branch twice
            if step > self._newest or step == resumed_at == self._newest:
                self._newest = step
                return
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

    def _settle(self, resumed_at: int | None) -> bool:
        """The first save: a run that loaded nothing is refused beside another run's remote checkpoints, or
        starts over (every committed checkpoint of both tiers set aside). Every rank takes rank 0's verdict.

        Returns:
            Whether this run started over (the remote's checkpoints are being set aside).

        Raises:
            ConfigError: the remote holds committed checkpoints and this run neither resumed nor started over.
        """
        fresh = resumed_at is None
        refusal = None
        if self._leader and fresh and self._sync is not None and not self._start_over:
            listed = self._sync.wait_listed(self._listing_timeout_s)
            if listed is None:  # an outage: saves go on locally, the upload queue decides once it lists
                self._sync.fresh_run(lambda steps: ConfigError(self._refusal(steps)))
            elif listed:
                refusal = self._refusal(listed)
        if fresh and self._url is not None and not self._start_over:  # a verdict every rank can wait for
            refusal = self._agree(refusal)
        if refusal is not None:
            raise ConfigError(refusal)
        if not (fresh and self._start_over):
            return False
        if self._leader:
            for step in self._local.committed_steps():
                self._local.set_aside(step, START)
            if self._sync is not None:
                self._sync.start_branch(START)
        return True

    def _refusal(self, remote_steps: set[int]) -> str:
        return (
            f"remote_url={self._url!r} holds committed checkpoints of another run (newest step {max(remote_steps)}, "
            f"{len(remote_steps)} in all) and this run loaded none: its saves would replace or mix with them, so "
            "nothing of it is saved there. Either resume that run: engine.load() (Lightning: trainer.fit(..., "
            "ckpt_path=io.latest_path()); Accelerate: hook.resume(); HF Trainer: trainer.train("
            "resume_from_checkpoint=callback.resume_path())); or start over with start_over=True, which sets every "
            f"committed checkpoint of {self._url} and {self._root} aside as an abandoned branch (kept, listed by "
            "`persist ls`, never pruned); or give this run its own remote_url")
