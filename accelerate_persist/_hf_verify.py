"""The automatic resume check of :class:`~accelerate_persist.PersistTrainerCallback` (issue 55): after
``trainer.train(resume_from_checkpoint=callback.resume_path())`` resumed from a checkpoint the callback's reader
loaded, each part of the live state is compared with what was saved (:meth:`~persist_core.CheckpointEngine.
verify_resume`), under the keys the callback saves it with (``_checkpoint``), at the moment it is settled.

* ``rng`` right after the Trainer's ``_load_rng_state``. At an epoch boundary the Trainer restores the RNG after
  ``on_epoch_begin`` and before it builds the epoch's data iterator (which draws from it): a one-shot wrapper of the
  epoch's dataloader's ``set_epoch``, which the Trainer calls in between, checks it there. Within an epoch the
  Trainer restores it after skipping the trained batches, just before ``on_step_begin``: checked there. Not checked
  with ``ignore_data_skip=True`` (the Trainer does not restore it mid-epoch then).
* ``model``, ``optimizer``, ``scheduler``, ``scaler`` (the ``GradScaler`` of an fp16 run) and ``trainer_state`` at the
  first ``on_step_begin`` (after the Trainer's restore and every callback's ``on_train_begin`` / ``on_epoch_begin``).

``trainer_state`` is one value, the JSON the Trainer writes; the fields the Trainer sets from its arguments rather
than from the checkpoint (:data:`RECOMPUTED`) and the recorded ``TrainerControl`` (the flags of the moment) are taken
from the saved JSON before the comparison, and the fields that differ are logged by name. ``config`` (the Trainer
does not load it) is not compared. Keys torch adds to an optimizer's ``param_groups`` on load are not a mismatch
(:data:`NEW_OK`).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import torch

from persist_core.session import PersistSession

log = logging.getLogger(__name__)

__all__ = ["AT_STEP", "NEW_OK", "RECOMPUTED", "ResumeCheck"]

#: the top-level keys compared at the first step after the resume
AT_STEP = ("model", "optimizer", "scheduler", "scaler", "trainer_state")
#: key paths (globs) the live state may have that the checkpoint lacks: keys torch adds to param_groups on load
NEW_OK = ("optimizer/param_groups/*",)
#: TrainerState fields the Trainer sets from its arguments and the process (``init_training_references``), not from
#: the checkpoint
RECOMPUTED = ("max_steps", "num_train_epochs", "trial_name", "trial_params", "is_hyper_param_search",
              "is_local_process_zero", "is_world_process_zero")


class ResumeCheck:
    """One resume's check; :meth:`loaded` when the callback's reader loaded a checkpoint, then the Trainer events."""

    def __init__(self, session: PersistSession, live: Any) -> None:
        self._session = session
        self._live = live  # (state, control, kwargs) -> the callback's checkpoint dict
        self._step: int | None = None  # the step loaded, until the check is done
        self._saved_state: dict[str, Any] = {}  # the saved TrainerState (its JSON, parsed)
        self._rng_pending = False
        self._wrapped: Any = None

    def loaded(self, step: int, trainer_state: str) -> None:
        self._step, self._saved_state, self._rng_pending = step, json.loads(trainer_state), False

    def train_begin(self, state: Any) -> None:
        """A ``train`` starts: it resumed from the step loaded, or the check is dropped."""
        if self._step is not None and int(state.global_step) != self._step:
            self._step = None
        self._rng_pending = self._step is not None

    def epoch_begin(self, args: Any, kwargs: dict[str, Any]) -> None:
        """The first epoch after the resume: the RNG is restored before ``set_epoch`` when at an epoch boundary."""
        self._unwrap()
        if not self._rng_pending:
            return
        if args.ignore_data_skip:
            self._rng_pending = False
            log.info("RNG not verified: ignore_data_skip=True (the Trainer does not restore it within an epoch)")
            return
        loader = kwargs.get("train_dataloader")
        if loader is None or not hasattr(loader, "set_epoch"):
            return
        original = loader.set_epoch

        def set_epoch(epoch: int) -> Any:
            self._unwrap()
            self._verify_rng()
            return original(epoch)

        loader.set_epoch = set_epoch
        self._wrapped = loader

    def step_begin(self, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        """The first step after the resume: the RNG (restored just before, within an epoch) and the rest."""
        if self._step is None:
            return
        self._unwrap()
        if self._rng_pending:
            self._verify_rng()
        self._step = None
        live = self._live(state, control, kwargs)
        now = json.loads(live["trainer_state"])
        for name in RECOMPUTED:
            if name in self._saved_state:
                now[name] = self._saved_state[name]
        control_saved = (self._saved_state.get("stateful_callbacks") or {}).get("TrainerControl")
        if control_saved is not None and isinstance(now.get("stateful_callbacks"), dict):
            now["stateful_callbacks"]["TrainerControl"] = control_saved  # the flags of the moment
        differ = sorted(k for k in {*now, *self._saved_state} if now.get(k) != self._saved_state.get(k))
        if differ:
            log.warning("trainer_state differs from what was saved in: %s", ", ".join(differ))
        live["trainer_state"] = json.dumps(now, indent=2, sort_keys=True)
        self._session.verify_resume({k: live[k] for k in AT_STEP if live.get(k) is not None}, new_ok=NEW_OK,
                                           partial=True)

    def _verify_rng(self) -> None:
        self._rng_pending = False
        self._session.verify_resume({"rng": rng_state()}, partial=True)

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("set_epoch", None)
            self._wrapped = None


def rng_state() -> dict[str, Any]:
    """What the Trainer's ``_save_rng_state`` keeps (one process)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state
