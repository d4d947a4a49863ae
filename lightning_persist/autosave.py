"""``PersistAutoSave``: a callback that saves when a save-decision policy says so; ``PersistOverlap``:
the fence that lets a save's copy overlap the next forward and backward.

Made with :meth:`PersistCheckpointIO.autosave`. At each training batch end, rank 0 asks the
policy (``Continuous``, ``EveryNSteps``, ``OptimalInterval``, ...) with the engine's view of the
last save and what saves cost, and broadcasts the answer, so every rank saves the same step or
none does. When Lightning has received SIGTERM during the batch (on any rank), every rank saves
that step whatever the policy says; Lightning then stops and the plugin's ``teardown`` flushes
the commit and upload within the grace period. With ``memory_every_n_steps`` it also keeps those steps in memory
(one process: those not saved to disk, whose copy is a snapshot already; several: each rank its own whole state,
under ``PersistDDPStrategy``; plain DDP calls the plugin on rank 0 only, so it saves to disk only, said once).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

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
        self.snapshot_steps: list[int] = []  # steps kept in memory only (memory_every_n_steps)
        self._asked = -1  # the last step offered to the memory tier (taken or not)
        self._said_ranks = False

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step = trainer.global_step
        session = self._io._session
        memory = session.options.memory is not None and self._every_rank(trainer)
        if memory:
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
        # one process: a step saved to disk is a snapshot already; several: each rank's shard is a part of it
        if memory and (not session.saved(step) or session.collectives.world_size > 1):
            self._snapshot(trainer, step)

    def _every_rank(self, trainer: Any) -> bool:
        """Whether every rank has the plugin's engine (one process, or ``PersistDDPStrategy``): with plain DDP,
        Lightning calls the plugin on rank 0 only, and the memory tier is left out (said once)."""
        if trainer.world_size == self._io._session.collectives.world_size:
            return True
        if not self._said_ranks and trainer.is_global_zero:
            log.warning("with %s and %d processes Lightning calls the plugin on rank 0 only, so the memory tier "
                        "takes no snapshots and this run saves to disk only; pass strategy=PersistDDPStrategy() to "
                        "snapshot on every rank", type(trainer.strategy).__name__, trainer.world_size)
        self._said_ranks = True
        return False

    def _snapshot(self, trainer: Any, step: int) -> None:
        """The state Lightning would save at ``step``, into the memory tier: each rank's whole state, its own."""
        if self._asked == step:  # gradient accumulation: the same optimizer step, nothing new to keep; on every
            return  # rank alike, taken or not (with several nodes, maybe_snapshot is a collective call)
        self._asked = step
        engine = self._io._get_engine()  # the dump only when this rank's tier takes it (DDP's dump gathers nothing)
        if engine.maybe_snapshot(lambda: trainer._checkpoint_connector.dump_checkpoint(weights_only=False), step):
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
