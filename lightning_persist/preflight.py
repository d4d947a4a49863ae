"""What ``PersistCheckpointIO`` checks before the first training batch: a ``CheckpointIO`` gets no call before
its first save (an epoch in, perhaps), so these checks run from a callback Lightning adds to every ``Trainer``
through its ``lightning.pytorch.callbacks_factory`` entry point. It does nothing unless the Trainer's
checkpoint IO is a :class:`~lightning_persist.PersistCheckpointIO`.

* What the plugin cannot work with, found at ``setup``: a ``ModelCheckpoint(dirpath=...)`` that is a URL (the
  remote tier is ``remote_url``), a strategy that saves through the plugin but cannot resume from it (and the
  warning for strategies that go around it), instead of at the first save, an epoch in.
* A run that resumed nothing, on a ``remote_url`` that holds committed checkpoints (another run's, or this
  run's from a machine that is gone): its saves would replace or mix with them. ``fit(ckpt_path="last")`` on a
  fresh machine is that run — Lightning resolves ``"last"`` to the local ``last.ckpt``, which a fresh machine
  lacks, and trains from scratch. Refused on every rank (rank 0 lists the remote and decides), naming
  ``ckpt_path=io.latest_path()`` and ``start_over=True``.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_persist._paths import path_key
from lightning_persist._strategies import check_strategy
from lightning_persist.snapshots import PersistMemorySnapshots
from lightning_persist.verify import PersistResumeCheck
from persist_core import ConfigError, PersistError

log = logging.getLogger(__name__)

__all__ = ["PersistPreflight", "callbacks"]


def callbacks() -> list[Callback]:
    """The entry point Lightning calls for every ``Trainer`` (group ``lightning.pytorch.callbacks_factory``): the
    checks before the first batch, the memory tier's snapshots (:mod:`lightning_persist.snapshots`) and the check of
    a resume (:mod:`lightning_persist.verify`)."""
    return [PersistPreflight(), PersistMemorySnapshots(persist_io_of), PersistResumeCheck(persist_io_of)]


def persist_io_of(trainer: Any) -> Any | None:
    """The Trainer's :class:`~lightning_persist.PersistCheckpointIO`, also behind a wrapping IO, or ``None``."""
    from lightning_persist.checkpoint_io import PersistCheckpointIO

    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    for _ in range(4):  # AsyncCheckpointIO and other wrappers hold the plugin as .checkpoint_io
        if isinstance(io, PersistCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


class PersistPreflight(Callback):
    """Refuses, before the first training batch, a ``fit`` that :class:`PersistCheckpointIO` would make lose or
    mix up checkpoints (see the module's docstring). Added to every Trainer by the entry point; inert otherwise."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = persist_io_of(trainer)
        if io is None:
            return
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                path_key(dirpath)  # a URL: ConfigError naming remote_url
        io._strategy_seen = check_strategy(trainer, io._strategy_seen)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        io = persist_io_of(trainer)
        if io is None:
            return
        refusal = fresh_run_refusal(io, trainer) if trainer.is_global_zero else None
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal is not None:
            raise ConfigError(refusal)


def fresh_run_refusal(io: Any, trainer: Any) -> str | None:
    """Why this ``fit`` may not train (rank 0): it resumed nothing and ``remote_url`` holds committed full
    checkpoints. ``None`` when it resumed, started over, has no remote, or the remote cannot be listed now
    (an outage: the engine decides once it lists it, and uploads nothing of this run beside another's)."""
    options = io._session.options
    if options.remote_url is None or options.start_over or trainer.ckpt_path is not None:
        return None
    reader = io._get_reader()
    if reader.loaded_step is not None:
        return None
    try:
        steps = [c.step for c in reader.list("remote")]
    except (PersistError, OSError) as e:
        log.warning("could not list %s before training (%s); the first save decides", options.remote_url, e)
        return None
    if not steps:
        return None
    return (f"remote_url={options.remote_url!r} holds committed checkpoints (newest step {max(steps)}) and this fit "
            "resumed none, so it would train from scratch and its saves would replace or mix with them (on a fresh "
            "machine ckpt_path='last' finds no local last.ckpt). Resume that run with trainer.fit(model, "
            "ckpt_path=io.latest_path()); or start over with PersistCheckpointIO(..., start_over=True), which sets "
            f"every committed checkpoint of {options.remote_url} and {options.local_dir} aside as an abandoned "
            "branch (kept, listed by `persist ls`, never pruned); or give this run its own remote_url. Nothing was "
            "trained or saved")
