"""The memory tier in a Lightning run: ``PersistCheckpointIO(memory_every_n_steps=N)`` on its own keeps a snapshot
every N optimizer steps.

A ``CheckpointIO`` gets no call per step, so the snapshots are taken by :class:`PersistMemorySnapshots`, a callback
Lightning adds to every ``Trainer`` through the plugin's ``lightning.pytorch.callbacks_factory`` entry point (inert
unless the Trainer's checkpoint IO is a :class:`~lightning_persist.PersistCheckpointIO` with a memory tier). It
offers each optimizer step to the tier at ``on_train_batch_end`` — after the update, the step-interval schedulers
and the step count, the state ``ModelCheckpoint`` saves at the same hook — and waits for that snapshot's commit (its
record is written in the background) before the next update, so a kill anywhere loses at most one step. It offers
through :func:`offer`, which
``io.autosave(...)`` calls too: the session marks the step offered, so a step is snapshot once whichever callback
comes first (gradient accumulation offers one optimizer step several times: once taken or not).

Where the entry point is not installed (a source tree on ``sys.path`` without ``pip install``) the plugin warns once,
naming the fix (:func:`warn_without_entry_point`); a strategy that cannot snapshot on every rank is said once too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from lightning.pytorch.callbacks import Callback


log = logging.getLogger(__name__)

__all__ = ["PersistMemorySnapshots", "offer", "warn_without_entry_point"]

ENTRY_POINT_GROUP = "lightning.pytorch.callbacks_factory"
ENTRY_POINT_NAME = "torch_persist"


class PersistMemorySnapshots(Callback):
    """Offers each optimizer step to the memory tier of the Trainer's :class:`PersistCheckpointIO` (see the module's
    docstring). Added to every Trainer by the entry point; does nothing without a memory tier.

    Args:
        io_of: the Trainer's plugin, or ``None`` (:func:`lightning_persist.preflight.persist_io_of`).
    """

    def __init__(self, io_of: Callable[[Any], Any]) -> None:
        self._io_of = io_of

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        io = self._io_of(trainer)
        if io is not None and io._session.options.memory is not None:
            offer(io, trainer)

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        """Before an update, the last snapshot is committed: a kill after the update loses that one step only."""
        io = self._io_of(trainer)
        engine = None if io is None or io._session.options.memory is None else io._session.engine
        if engine is not None:
            engine.wait_snapshot()


def offer(io: Any, trainer: Any) -> bool:
    """Offer ``trainer.global_step`` to ``io``'s memory tier, once per step for the run; whether a snapshot was taken.

    One process: a step already saved to disk is a snapshot already (its copy is the tier's slot). Several ranks:
    every rank offers the same steps (with several nodes a snapshot step is a collective call).
    """
    session = io._session
    step = trainer.global_step
    if not _can_snapshot(io, trainer) or not session.first_offer(step):
        return False
    engine = io._get_engine()  # the dump only when this rank's tier takes it (DDP's dump gathers nothing)
    return engine.maybe_snapshot(lambda: trainer._checkpoint_connector.dump_checkpoint(weights_only=False), step)


def _can_snapshot(io: Any, trainer: Any) -> bool:
    """Whether every rank has the plugin's engine and the strategy's state is one each rank holds whole (one process,
    or ``PersistDDPStrategy``); otherwise said once, and the run saves to disk only."""
    session = io._session
    reason = None
    if type(trainer.strategy).__name__ in ("ModelParallelStrategy", "PersistModelParallelStrategy", "FSDPStrategy",
                                           "DeepSpeedStrategy"):
        reason = (f"{type(trainer.strategy).__name__} shards the state across ranks, which the memory tier does not "
                  "snapshot yet")
    elif trainer.world_size != session.collectives.world_size:
        reason = (f"with {type(trainer.strategy).__name__} and {trainer.world_size} processes Lightning calls the "
                  "plugin on rank 0 only; pass strategy=PersistDDPStrategy() to snapshot on every rank")
    if reason is None:
        io._get_engine()  # opened on every rank at once: with several, opening is a collective call
        return True
    if not io._memory_refusal_said and trainer.is_global_zero:
        log.warning("memory_every_n_steps: %s, so this run takes no snapshots in memory and saves to disk only",
                    reason)
    io._memory_refusal_said = True
    return False


def warn_without_entry_point() -> None:
    """Say once, naming the fix, that Lightning will not add :class:`PersistMemorySnapshots` to the Trainers of this
    process: the package's entry point is not installed (a source tree on ``sys.path``)."""
    if any(ep.name == ENTRY_POINT_NAME for ep in entry_points(group=ENTRY_POINT_GROUP)):
        return
    log.warning("memory_every_n_steps: torch-persist's Lightning entry point is not installed (a source tree on "
                "sys.path without `pip install`), so no Trainer snapshots in memory by itself: `pip install "
                "torch-persist` (or `pip install -e .` in the source tree), or pass callbacks=[io.autosave(None)]")
