"""``PersistTrainerCallback``: the Hugging Face ``transformers.Trainer``'s saves through the torch-persist engine.

The Trainer runs on Accelerate but never calls ``save_state``: at each ``save_steps`` (or epoch) it
writes ``output_dir/checkpoint-N/`` synchronously. This callback takes those saves over: when the
Trainer decides to save (``control.should_save``, set by its own flow callback at ``on_step_end`` /
``on_epoch_end``), the callback clears the flag — the Trainer then writes nothing — and saves the
same state (model, optimizer, scheduler, GradScaler, RNG states, ``trainer_state.json``) through the engine:
asynchronous, verified, synced to ``remote_url``, retained.

The save is taken where the Trainer's own would be: the Trainer logs the step and evaluates after
``on_step_end`` and saves after both, so a step that is to be logged or evaluated is saved at its
``on_log`` (once no evaluation is left) or ``on_evaluate``. ``trainer_state.json`` is then what the
Trainer writes at that save, the step's log entry included, and a resumed run's ``log_history``
is the uninterrupted run's.

Resume: ``trainer.train(resume_from_checkpoint=callback.resume_path())``. The Trainer resumes only
from a local directory in its own layout (and silently skips a missing optimizer or RNG file),
so :meth:`PersistTrainerCallback.resume_path` writes the newest committed checkpoint (downloaded
first on a fresh machine, verified) as exactly the files the Trainer reads, under
``local_dir/.trainer/checkpoint-N``.

Importing this module imports ``transformers``; ``accelerate_persist`` imports it only on first use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from accelerate_persist._hf_verify import ResumeCheck, rng_state
from persist_core import ConfigError
from persist_core.config import adapter_config, keyword_options
from persist_core.layout import TRAINER_DIRNAME, trainer_checkpoint_dirname
from persist_core.session import PersistSession

log = logging.getLogger(__name__)

# the Trainer's own file names (transformers.trainer)
_WEIGHTS, _CONFIG, _OPTIMIZER, _SCHEDULER = "model.safetensors", "config.json", "optimizer.pt", "scheduler.pt"
_RNG, _STATE, _SCALER = "rng_state.pth", "trainer_state.json", "scaler.pt"


@keyword_options("PersistTrainerCallback")  # **keywords: the options of persist_core.config.ENTRY_POINTS
class PersistTrainerCallback(TrainerCallback):
    """Asynchronous, verified, synced checkpoints for ``transformers.Trainer`` in one line.

    Example::

        callback = PersistTrainerCallback(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7", keep_last=3)
        trainer = Trainer(model=model, args=TrainingArguments(..., save_steps=500), callbacks=[callback], ...)
        trainer.train(resume_from_checkpoint=callback.resume_path())   # None on a first run

    Saves happen where the Trainer's ``save_strategy``/``save_steps`` put them, at the point of the
    step the Trainer would write its own (after it logs and evaluates that step); each is the step
    ``state.global_step``. Options that need the Trainer's own ``checkpoint-N`` directories are
    refused when the Trainer is built (``load_best_model_at_end``, ``save_total_limit`` — use
    ``keep_last`` —, ``save_strategy="best"``), as are several processes, DeepSpeed and FSDP (not
    supported by this callback yet).

    Memory snapshots (``memory_every_n_steps``) are taken at the end of the steps the Trainer does not save;
    :meth:`resume_path` names the newest. ``incremental=True`` writes a PEFT model's frozen base once every
    ``full_every`` saves.

    Args:
        local_dir: the local tier's directory (created if missing), ideally on NVMe.
    """

    def __init__(self, local_dir: str | os.PathLike[str], **keywords: Any) -> None:
        options = adapter_config("PersistTrainerCallback", local_dir, keywords)
        self._session = PersistSession(
            options, resume_hint="resume with trainer.train(resume_from_checkpoint=callback.resume_path())")
        self.saved_steps: list[int] = []
        self.snapshot_steps: list[int] = []  # the steps kept in memory (memory_every_n_steps)
        self._pending: tuple[int, dict[str, Any]] | None = None  # a save taken over, not yet at its point
        self._check = ResumeCheck(self._session, lambda state, control, kwargs: _checkpoint(
            state, control, kwargs, saving=False))  # the automatic resume check (issue 55)

    # ------------------------------------------------------------------ Trainer events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse what needs the Trainer's own checkpoint directories (the Trainer is being built)."""
        refused = [(args.load_best_model_at_end, "load_best_model_at_end=True",
                    "load the best step with callback.resume_path() / CheckpointReader yourself"),
                   (args.save_total_limit is not None, f"save_total_limit={args.save_total_limit}",
                    f"PersistTrainerCallback(keep_last={args.save_total_limit})"),
                   (str(getattr(args.save_strategy, "value", args.save_strategy)) == "best", "save_strategy='best'",
                    "save_strategy='steps' with save_steps=N"),
                   (args.world_size > 1, f"{args.world_size} processes", "one process (several: not supported yet)"),
                   (bool(args.deepspeed) or bool(args.fsdp), "DeepSpeed/FSDP", "plain data parallel or one device")]
        for bad, what, fix in refused:
            if bad:
                raise ConfigError(f"PersistTrainerCallback does not work with {what}: the Trainer's own checkpoint-N "
                                  f"directories are not written; use {fix}")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check.train_begin(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = self._take_over(state, control, kwargs)
        self._snapshot(state, control, kwargs)
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before an update, the last snapshot is committed (its record is written in the background): a kill after
        the update loses that one step only."""
        engine = self._session.engine if self._session.options.memory is not None else None
        if engine is not None:
            engine.wait_snapshot()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._save_pending(state, control)
        return self._take_over(state, control, kwargs)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer logged the step: its save is due now, unless an evaluation of it is still to come."""
        if not control.should_evaluate:
            self._save_pending(state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer evaluated the step (its metrics are logged): its save is due now."""
        self._save_pending(state, control)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A save whose log or evaluation never came is due before the next epoch."""
        self._save_pending(state, control)
        self._check.epoch_begin(args, kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A save whose log or evaluation never came is due before the next step; the first after a resume is checked."""
        self._save_pending(state, control)
        self._check.step_begin(state, control, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait for pending saves and uploads, log the summary; raises a background failure once."""
        self._save_pending(state, control)
        self._session.close()

    # ------------------------------------------------------------------ saving

    def _take_over(self, state: Any, control: Any, kwargs: dict[str, Any]) -> Any:
        """Clear the Trainer's decision to save and save the step at the point the Trainer would.

        The Trainer runs ``on_step_end`` / ``on_epoch_end``, then logs the step (``on_log``), then
        evaluates it (its metrics logged, then ``on_evaluate``), then saves. A step with neither a
        log nor an evaluation to come is saved now; otherwise at the last of those events.
        """
        if not control.should_save:
            return control
        control.should_save = False  # the Trainer writes nothing itself
        self._save_pending(state, control)  # one whose log or evaluation never came
        step = int(state.global_step)
        if self._session.saved(step):
            return control
        self._pending = (step, kwargs)
        if not (control.should_log or control.should_evaluate):
            self._save_pending(state, control)
        return control

    def _save_pending(self, state: Any, control: Any) -> None:
        """Save the step taken over, if any, with the state the Trainer's own save would write."""
        if self._pending is None:
            return
        step, kwargs = self._pending
        self._pending = None
        self._session.save(_checkpoint(state, control, kwargs, saving=True), step, metadata=_SAVED_BY)
        self._session.report()
        self.saved_steps.append(step)

    def _snapshot(self, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        """Keep the step just ended in memory, when the memory tier is due and the Trainer does not save it."""
        memory, step = self._session.options.memory, int(state.global_step)
        if memory is None or not memory.due(step) or self._pending is not None or self._session.saved(step):
            return
        engine = self._session.open()
        if engine.maybe_snapshot(lambda: _checkpoint(state, control, kwargs, saving=False), step, metadata=_SAVED_BY):
            self.snapshot_steps.append(step)

    def wait(self) -> None:
        """Block until every pending save is committed and uploaded; raises a background failure once."""
        self._session.wait()

    # ------------------------------------------------------------------ resume

    def resume_path(self) -> str | None:
        """The newest committed checkpoint as a directory the Trainer resumes from, or ``None``; with
        ``memory_every_n_steps``, the newest memory snapshot when it is newer (and verifies).

        Downloads it first when ``local_dir`` has none (a fresh machine), verifies every chunk, and
        writes ``local_dir/.trainer/checkpoint-N`` with exactly the files the Trainer reads: the
        weights, ``config.json``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` and
        ``trainer_state.json``, and ``scaler.pt`` when the run had a ``GradScaler`` (fp16). Pass it to ``trainer.train(resume_from_checkpoint=...)``.
        """
        reader = self._session.reader
        info = reader.latest()
        if info is None:
            return None
        out = self._session.options.local_dir / TRAINER_DIRNAME / trainer_checkpoint_dirname(info.step)
        if (out / _STATE).is_file():
            return str(out)
        checkpoint = reader.load()  # the newest that verifies (a torn memory snapshot: the next source or step)
        step = reader.loaded_step
        if not (isinstance(checkpoint, dict) and "trainer_state" in checkpoint):
            raise ConfigError(f"checkpoint step {step} in {self._session.options.local_dir} was not saved by "
                              "PersistTrainerCallback; the Trainer cannot resume from it")
        out = out.with_name(trainer_checkpoint_dirname(step))
        _materialize(checkpoint, out)
        self._check.loaded(step, checkpoint["trainer_state"])
        return str(out)


_SAVED_BY = {"saved_by": "accelerate_persist.PersistTrainerCallback"}


def _checkpoint(state: Any, control: Any, kwargs: dict[str, Any], *, saving: bool) -> dict[str, Any]:
    """What the Trainer's own save of ``state``'s step writes (``saving``: recorded as a save, as the Trainer's)."""
    model = kwargs["model"]
    scaler = getattr(kwargs["optimizer"], "scaler", None)  # fp16: Accelerate's GradScaler, on the prepared optimizer
    stateful = dict(state.stateful_callbacks or {})
    recorded = control.state()
    recorded["args"]["should_save"] = saving  # as the Trainer records it in its own save (it is saving)
    stateful["TrainerControl"] = recorded
    trainer_state = json.dumps({**dataclasses.asdict(state), "stateful_callbacks": stateful}, indent=2, sort_keys=True)
    return {
        "model": model.state_dict(),
        "config": model.config.to_json_string() if hasattr(model, "config") else None,
        "optimizer": kwargs["optimizer"].state_dict(),
        "scheduler": kwargs["lr_scheduler"].state_dict() if kwargs.get("lr_scheduler") is not None else None,
        "rng": rng_state(),
        "trainer_state": trainer_state,
        "scaler": None if scaler is None else scaler.state_dict(),
    }


def _materialize(checkpoint: dict[str, Any], out: Path) -> None:
    """Write the Trainer's checkpoint files into ``out`` (a temporary name, then one rename)."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in checkpoint["model"].items():  # safetensors refuses shared storage (tied weights)
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if key not in seen:
            weights[name] = tensor.contiguous()
        seen.add(key)
    save_file(weights, str(tmp / _WEIGHTS), metadata={"format": "pt"})
    if checkpoint.get("config") is not None:
        (tmp / _CONFIG).write_text(checkpoint["config"])
    torch.save(checkpoint["optimizer"], tmp / _OPTIMIZER)
    if checkpoint.get("scheduler") is not None:
        torch.save(checkpoint["scheduler"], tmp / _SCHEDULER)
    torch.save(checkpoint["rng"], tmp / _RNG)
    if checkpoint.get("scaler") is not None:  # the Trainer's _load_scaler reads it (checkpoints before it: none)
        torch.save(checkpoint["scaler"], tmp / _SCALER)
    (tmp / _STATE).write_text(checkpoint["trainer_state"])
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
