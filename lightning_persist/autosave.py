"""``PersistAutoSave``: a callback that saves when a save-decision policy says so; ``PersistOverlap``:
the fence that lets a save's copy overlap the next forward and backward.

Made with :meth:`PersistCheckpointIO.autosave`. At each training batch end, rank 0 asks the
policy (``Continuous``, ``EveryNSteps``, ``OptimalInterval``, ...) with the engine's view of the
last save and what saves cost, and broadcasts the answer, so every rank saves the same step or
none does. When Lightning has received SIGTERM during the batch (on any rank), every rank saves
that step whatever the policy says; Lightning then stops and the plugin's ``teardown`` flushes
the commit and upload within the grace period. With ``memory_every_n_steps`` it offers each step to the memory tier
after its own save (:func:`lightning_persist.snapshots.offer`: one process skips a step just saved to disk, whose
copy is a snapshot already), so the entry point's callback, which offers it too, finds it taken.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_persist.snapshots import offer
from persist_core.policies import SavePolicy, check_save_policy

log = logging.getLogger(__name__)


class PersistAutoSave(Callback):
    """Saves ``local_dir/<filename>`` (one link, replaced each time) when ``policy`` says so.

    Args:
        io: the plugin the Trainer uses.
        policy: the save-decision policy.
        filename: the name of the link to the newest autosaved checkpoint.
    """

    def __init__(self, io: Any, policy: SavePolicy | None, filename: str = "autosave.ckpt") -> None:
        self._io = io
        self._policy = None if policy is None else check_save_policy(policy)
        self._filename = filename
        self.saved_steps: list[int] = []
        self.snapshot_steps: list[int] = []  # steps this callback kept in memory (memory_every_n_steps)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step = trainer.global_step
        session = self._io._session
        if session.options.memory is not None and trainer.world_size == session.collectives.world_size:
            self._io._get_engine()  # opened on every rank at once: with several, opening is a collective call
        decision = False
        if trainer.is_global_zero and self._policy is not None:
            decision = not session.saved(step) and self._io._get_engine().should_save(step, policy=self._policy)
        decision = trainer.strategy.broadcast(decision, src=0)
        # SIGTERM on any rank: every rank saves this step (Lightning then stops; teardown flushes)
        if trainer.strategy.reduce_boolean_decision(bool(trainer.received_sigterm), all=False):
            decision = True
        if decision:
            trainer.save_checkpoint(os.path.join(str(self._io.local_dir), self._filename))
            self.saved_steps.append(step)
        if session.options.memory is not None and offer(self._io, trainer):  # once a step, whoever offers first
            self.snapshot_steps.append(step)


class PersistOverlap(Callback):
    """Made by :meth:`PersistCheckpointIO.overlap`: guards the Trainer's optimizers on the plugin's engine
    (no step pre-hook: Lightning runs forward and backward inside ``optimizer.step(closure)``) and fences
    in ``on_before_optimizer_step`` — after the backward, before the update."""

    def __init__(self, io: Any) -> None:
        self._io = io
        self._guard: Any = None
        self.fence_s = 0.0  # what the updates waited for copies, all told
        self.overlapped = 0  # saves whose copy ran during the next forward and backward

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        if optimizers:
            self._guard = self._io._get_engine().guard(*optimizers, step_hook=False)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._guard is not None:
            self.fence_s += self._io._get_engine().fence()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self._guard is not None:  # the writes' turn, also when a GradScaler skipped the step (no post-hook)
            self._io._get_engine().after_update()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._guard is not None:
            self._guard.remove()  # after the pending copy (not an update's wait: no step follows)
            self.overlapped = self._io._get_engine().summary()["overlapped_saves"]
            self._guard = None
