"""The automatic resume check in a Lightning run (issue 55): before the first training batch after a ``fit`` resumed
from a checkpoint :class:`~lightning_persist.PersistCheckpointIO` loaded — after Lightning, the strategy, the
callbacks and the user's ``on_load_checkpoint`` and ``on_train_start`` ran — the live state is compared with what was
saved (:meth:`~persist_core.CheckpointEngine.verify_resume`, which warns, raises or logs "resume verified").

The live state is built from the live objects, keyed as Lightning's checkpoint dict, without the user hooks
``dump_checkpoint`` runs: ``state_dict`` (the module's), ``optimizer_states`` (the strategy's view of each optimizer),
``lr_schedulers``, ``callbacks`` (each callback's ``state_dict``), the datamodule's state and the precision plugin's
(the ``GradScaler``), each under the key Lightning saves it with. Only those top-level keys are compared; what
legitimately differs after a restore is excluded by name: :data:`EXCLUDED` (``loops``' progress, the ``Timer``), a
``ModelCheckpoint`` whose ``dirpath`` changed (Lightning then restores only its ``best_model_path``), and keys torch
adds to ``param_groups`` on load (:data:`NEW_OK`). ``epoch``, ``global_step``, ``pytorch-lightning_version``, the
hyper-parameters and the user's own ``on_save_checkpoint`` keys are not in the live state, so not compared.
Lightning saves no RNG state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer import call


log = logging.getLogger(__name__)

__all__ = ["EXCLUDED", "NEW_OK", "PersistResumeCheck", "live_state"]

#: key paths (globs) that legitimately differ after a restore: the loops' progress, the Timer's elapsed time, and
#: the score a ModelCheckpoint last saw (Lightning does not restore it)
EXCLUDED = ("loops/*", "callbacks/Timer*", "callbacks/ModelCheckpoint*/current_score")
#: key paths (globs) the live state may have that the checkpoint lacks: keys torch adds to param_groups on load
NEW_OK = ("optimizer_states/*/param_groups/*",)


class PersistResumeCheck(Callback):
    """Verifies, once, before the first training batch of a ``fit`` that resumed from a checkpoint the Trainer's
    :class:`PersistCheckpointIO` loaded, that the live state equals what was saved (see the module's docstring).
    Added to every Trainer by the entry point; inert otherwise."""

    def __init__(self, io_of: Callable[[Any], Any]) -> None:
        self._io_of = io_of  # the Trainer's plugin, or None (lightning_persist.preflight.persist_io_of)
        self._saved_dirpaths: dict[str, Any] = {}  # ModelCheckpoint state key -> the dirpath the checkpoint has

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = self._io_of(trainer)
        if io is not None:
            io._resume_loaded = False  # a load from now on is this fit's restore
        self._saved_dirpaths = {}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks") or {}
        self._saved_dirpaths = {cb.state_key: states[cb.state_key].get("dirpath") for cb in trainer.checkpoint_callbacks
                                if isinstance(states.get(cb.state_key), dict)}

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        io = self._io_of(trainer)
        if io is None or not io._resume_loaded or trainer.ckpt_path is None:
            return
        io._resume_loaded = False
        if trainer.world_size != io._session.collectives.world_size and not trainer.is_global_zero:
            return  # Lightning's own DDP: the plugin works on rank 0 only (PersistDDPStrategy: on every rank)
        state = live_state(trainer)
        moved = [f"callbacks/{_escape(cb.state_key)}/*" for cb in trainer.checkpoint_callbacks
                 if self._saved_dirpaths.get(cb.state_key, cb.dirpath) != cb.dirpath]
        io._session.verify_resume(state, ignore=(*EXCLUDED, *moved), new_ok=NEW_OK, partial=True)


def live_state(trainer: Any) -> dict[str, Any]:
    """The parts of Lightning's checkpoint dict a restore sets, from the live objects (no user hooks run)."""
    state: dict[str, Any] = {
        "state_dict": trainer.lightning_module.state_dict(),
        "optimizer_states": [trainer.strategy.optimizer_state(o) for o in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "callbacks": call._call_callbacks_state_dict(trainer),
    }
    datamodule = trainer.datamodule
    if datamodule is not None:
        dm_state = datamodule.state_dict()
        if dm_state:
            state[type(datamodule).__qualname__] = dm_state
    precision = trainer.precision_plugin
    precision_state = precision.state_dict()
    if precision_state:
        state[type(precision).__qualname__] = precision_state
    return state


def _escape(text: str) -> str:
    """``text`` as a literal in an ``fnmatch`` glob."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
