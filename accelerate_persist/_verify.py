"""The automatic resume check under Accelerate (issue 55): each part of the restored state is compared with what was
saved (:meth:`~persist_core.CheckpointEngine.verify_resume`) at the moment it is settled.

* Right after the restore (``hook.resume()`` / ``accelerator.load_state()``): the RNG states and the step of every
  process (``per_process``) and the dataloaders' states (``dataloaders``: samplers' generators, positions) — by the
  first forward the RNG and the data have moved, and Accelerate's own loader swallows RNG restore failures.
* At the first forward after it (a one-shot forward pre-hook on the first prepared model, before the forward draws
  from the RNG or moves a BatchNorm's statistics): ``models``, ``optimizers``, ``schedulers``, ``scaler``,
  ``custom`` (the objects registered for checkpointing) and ``optimizer_steps`` — what the user's code between the
  restore and the first step may have changed. With no prepared model, at once.

Not compared: ``iteration`` (the restore sets it one past the saved one, by design). Keys torch adds to an
optimizer's ``param_groups`` on load are not a mismatch (:data:`NEW_OK`).
"""

from __future__ import annotations

import logging
from typing import Any

from accelerate_persist import _state
from persist_core.session import PersistSession

log = logging.getLogger(__name__)

__all__ = ["AT_FORWARD", "AT_RESTORE", "NEW_OK", "ResumeCheck"]

#: the top-level keys of the saved state compared right after the restore
AT_RESTORE = ("per_process", "dataloaders")
#: the top-level keys compared at the first forward after it
AT_FORWARD = ("models", "optimizers", "schedulers", "scaler", "custom", "optimizer_steps")
#: key paths (globs) the live state may have that the checkpoint lacks: keys torch adds to param_groups on load
NEW_OK = ("optimizers/*/param_groups/*",)


class ResumeCheck:
    """Checks a restore in two parts (see the module's docstring); :meth:`restored` after each restore,
    :meth:`remove` at the hook's close (every process alike: the live RNG states are gathered)."""

    def __init__(self, session: PersistSession, accelerator: Any) -> None:
        self._session = session
        self._accelerator = accelerator
        self._handle: Any = None

    def restored(self, optimizer_steps: int, saved_processes: int) -> None:
        """The hook restored a checkpoint of its own, written by ``saved_processes`` processes: the RNG and the data
        now, the rest at the first forward. Another number of processes than now: the per-process states are not
        compared (each process took one of them, or process 0's)."""
        self.remove()
        resharded = saved_processes != self._accelerator.num_processes
        self._verify(AT_RESTORE, optimizer_steps, ignore=("per_process/*",) if resharded else ())
        models = self._accelerator._models
        if not models:
            self._verify(AT_FORWARD, optimizer_steps)
            return

        def first_forward(module: Any, args: Any) -> None:
            self.remove()
            self._verify(AT_FORWARD, optimizer_steps)

        self._handle = models[0].register_forward_pre_hook(first_forward)

    def remove(self) -> None:
        """Undo the pending forward pre-hook, if any. Idempotent."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _verify(self, keys: tuple[str, ...], optimizer_steps: int, ignore: tuple[str, ...] = ()) -> list[str]:
        live = _state.capture(self._accelerator, optimizer_steps=optimizer_steps)
        if ignore:
            log.info("per-process states (RNG, step) not verified (resharded: another number of processes)")
        return self._session.verify_resume({k: live[k] for k in keys}, ignore=ignore, new_ok=NEW_OK,
                                                  partial=True)
