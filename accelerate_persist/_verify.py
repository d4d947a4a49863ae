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

__all__ = ["AT_FORWARD", "AT_RESTORE", "NEW_OK", "ResumeCheck", "not_restored"]

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
        now = self._accelerator.num_processes
        ignore: tuple[str, ...] = ()
        if saved_processes != now:  # the processes both runs have are compared; the rest is said, never a mismatch
            ignore = tuple(f"per_process/{i}/*" for i in range(min(saved_processes, now), max(saved_processes, now)))
            if self._accelerator.process_index == 0:
                log.warning("%s", not_restored(saved_processes, now))
        self._verify(AT_RESTORE, optimizer_steps, ignore=ignore)
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
            log.info("%s not verified (resharded: another number of processes)",
                     ", ".join(g.removesuffix("/*") for g in ignore))
        return self._session.verify_resume({k: live[k] for k in keys}, ignore=ignore, new_ok=NEW_OK,
                                                  partial=True)


def not_restored(saved: int, now: int) -> str:
    """What a restore on ``now`` processes of a checkpoint ``saved`` processes wrote could not restore as saved
    (:func:`accelerate_persist._state.apply`: process ``i`` takes process ``i``'s RNG states and step, a process the
    checkpoint has none for takes process 0's)."""
    head = f"resumed on {now} process(es) from a checkpoint {saved} process(es) wrote: "
    if now < saved:
        lost = f"the RNG states and step of process(es) {_span(now, saved)} are restored on no process"
    else:
        lost = (f"process(es) {_span(saved, now)} took process 0's RNG states and step (the checkpoint has none of "
                "theirs): their random streams repeat process 0's")
    return (head + lost + "; the dataloaders' positions are restored as the saved processes left them, so the "
            f"samples each process sees from here differ from a run on {saved} process(es)")


def _span(first: int, end: int) -> str:
    return str(first) if end - first == 1 else f"{first}..{end - 1}"
