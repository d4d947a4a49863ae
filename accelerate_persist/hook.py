"""``PersistHook``: Accelerate's ``save_state``/``load_state`` through the torch-persist engine.

Mechanism: :meth:`PersistHook.register` replaces the two methods *on that Accelerator instance*
(the smallest reliable wrapping: Accelerate's pre-hooks can veto the model weights but not the
optimizer, scheduler, sampler, RNG and custom-object files, which would still be written
synchronously). The user's calls stay as they are:

* ``accelerator.save_state()`` snapshots everything Accelerate itself would save — every
  prepared model (``get_state_dict(model, unwrap=False)``), optimizer, scheduler, the GradScaler,
  dataloader sampler / ``StatefulDataLoader`` states, the objects of ``register_for_checkpointing``,
  each process's RNG states and ``accelerator.step`` — into host memory and returns; the write,
  commit, upload and retention go on in the background.
* ``accelerator.load_state()`` restores the newest committed checkpoint (local, else remote), or
  the one a path or URL names, verified.

Every process calls both (as Accelerate requires). With several processes each writes about
``1/num_processes`` of the replicated state and the main process commits (see
:mod:`persist_core.commit`); per-process values (RNG states) are gathered so that every
checkpoint holds all of them.

The checkpoint's step is the number of optimizer steps taken (steps the GradScaler skipped, and
micro-batches of gradient accumulation, do not count) — what :meth:`PersistHook.resume` returns.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from persist_core import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointReader,
    ConfigError,
    KeepLastN,
    RetentionPolicy,
    SaveHandle,
    SingleProcess,
    StepExistsError,
    TorchCollectives,
)
from persist_core.layout import checkpoint_dirname
from persist_core.decisions import PreemptionNotice, SavePolicy, check_save_policy, describe_summary
from persist_core.preemption import check_grace, install_sigterm_flush
from persist_core.retention import policy_from_keywords

log = logging.getLogger(__name__)

_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")


class PersistHook:
    """Makes an Accelerator's ``save_state`` asynchronous, verified, synced and retained.

    Example::

        accelerator = Accelerator()
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        hook = PersistHook(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7", keep_last=3,
                           keep_every_n_steps=1000)
        hook.register(accelerator)
        step = hook.resume()              # the newest committed checkpoint (local, else remote); 0 on a first run
        for batch in accelerator.skip_first_batches(loader, step % len(loader)):
            ...
            if step % 100 == 0:
                accelerator.save_state()  # returns once staged
        hook.close()                      # or `with hook:`: drains, then unregisters

    Retention is the engine's, per tier, after each commit: ``keep_last`` /
    ``keep_every_n_steps`` / ``keep_every_n_seconds`` (or ``retention=``). Accelerate's
    ``ProjectConfiguration(total_limit=N)`` is taken as ``keep_last=N`` when no policy is given
    (never both: conflicting values are a ``ConfigError``); its ``automatic_checkpoint_naming``
    is not needed — checkpoints live in ``local_dir`` as ``step-N`` directories.

    Flush points: :meth:`wait`, :meth:`close`, ``with hook:``, ``accelerator.end_training()``,
    interpreter exit, and SIGTERM (a handler waits up to ``preemption_grace_s`` for the pending
    checkpoint and its upload, then chains to the previous handler).

    Limits: DDP/multi-CPU/single device. FSDP, DeepSpeed, Megatron-LM and XLA save through their
    own machinery and are refused at ``register``. ``local_dir`` must be one directory all
    processes of a node share; with several nodes, use a shared file system.

    Args:
        local_dir: the local tier (created if missing), ideally on NVMe.
        remote_url: an fsspec URL committed checkpoints are uploaded to, or ``None``.
        storage_options: passed to fsspec as-is.
        keep_last / keep_every_n_steps / keep_every_n_seconds / retention: retention, both tiers.
        verify: check checksums on load.
        max_pending: checkpoints staged or writing at once (each holds a host copy of the state).
        preemption_grace_s: how long SIGTERM waits for pending work (default 120 s).
        save_policy: when :meth:`maybe_save` saves (``Continuous(min_interval_s=30)``,
            ``EveryNSteps(1000)``, ``OptimalInterval(mtbf_s=...)``). With one, SIGTERM only sets a
            flag: the next ``maybe_save`` saves on every process, flushes within the grace
            period, and :attr:`preempted` tells the loop to stop.
        preemption_signals: the signals that mean "preempted" when a ``save_policy`` is given
            (default SIGTERM; e.g. ``(signal.SIGTERM, signal.SIGUSR1)`` for a scheduler's warning).
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        remote_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        keep_every_n_seconds: float | None = None,
        retention: RetentionPolicy | None = None,
        verify: bool = True,
        max_pending: int = 1,
        preemption_grace_s: float = 120.0,
        save_policy: SavePolicy | None = None,
        preemption_signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        self._local_dir = Path(local_dir).expanduser().absolute()
        self._remote_url = remote_url
        self._storage_options = storage_options
        self._policy = policy_from_keywords(keep_last, keep_every_n_steps, keep_every_n_seconds, retention)
        self._verify = verify
        self._max_pending = max_pending
        self._grace_s = check_grace(preemption_grace_s)
        self._save_policy = None if save_policy is None else check_save_policy(save_policy)
        self._notice: PreemptionNotice | None = None
        self._signals = tuple(preemption_signals)
        if not self._signals:
            raise ConfigError("preemption_signals=() is empty; pass at least one, e.g. (signal.SIGTERM,)")
        self._accelerator: Any = None
        self._engine: CheckpointEngine | None = None
        self._originals: dict[str, Any] = {}
        self._optimizer_steps = 0
        self._saved: set[int] = set()
        self._unlogged: list[SaveHandle] = []
        self._restore_signal: Any = None

    # ------------------------------------------------------------------ registration

    def register(self, accelerator: Any) -> PersistHook:
        """Route ``accelerator.save_state``/``load_state`` through this hook (every process calls this).

        Raises:
            ConfigError: an unsupported distributed type, a ``total_limit`` that conflicts with
                the hook's retention, or a second registration.
        """
        if self._accelerator is not None:
            raise ConfigError("this PersistHook is registered already; close() it before registering it again")
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if kind not in _SUPPORTED:
            raise ConfigError(
                f"PersistHook does not support distributed_type={kind}: it saves through its own machinery; "
                f"use DDP, multi-CPU or one device ({', '.join(_SUPPORTED)})"
            )
        config = accelerator.project_configuration
        if config.total_limit is not None:
            if self._policy is None:
                self._policy = KeepLastN(config.total_limit)
                log.info("ProjectConfiguration(total_limit=%d) becomes keep_last=%d (applied after each commit)",
                         config.total_limit, config.total_limit)
            elif self._policy != KeepLastN(config.total_limit):
                raise ConfigError(
                    f"ProjectConfiguration(total_limit={config.total_limit}) conflicts with the hook's retention "
                    f"{self._policy!r}: set one of them (the hook applies retention after each commit)"
                )
        collectives = TorchCollectives.new_group() if accelerator.num_processes > 1 else SingleProcess()
        if self._save_policy is not None and self._notice is None:
            self._notice = PreemptionNotice(self._signals)
        self._engine = CheckpointEngine(
            self._local_dir, remote_url=self._remote_url, storage_options=self._storage_options,
            keep_local=self._policy, keep_remote=self._policy if self._remote_url else None, verify=self._verify,
            max_pending=self._max_pending, collectives=collectives, save_policy=self._save_policy,
            preemption=self._notice, preemption_grace_s=self._grace_s,
        )
        self._accelerator = accelerator
        self._originals = {name: getattr(accelerator, name) for name in ("save_state", "load_state", "end_training")}
        accelerator.save_state = self._save_state
        accelerator.load_state = self._load_state
        accelerator.end_training = self._end_training
        for optimizer in accelerator._optimizers:
            self._count_steps(optimizer)
        if self._restore_signal is None and self._notice is None:
            self._restore_signal = install_sigterm_flush(
                lambda: None if self._engine is None else self._engine.wait, self._grace_s)
        return self

    def _count_steps(self, optimizer: Any) -> None:
        """Count the optimizer steps that happened (not accumulation micro-batches, not skipped steps)."""
        if getattr(optimizer, "_persist_counted", False):
            return
        step = optimizer.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            syncing = getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True)
            if syncing and not getattr(optimizer, "step_was_skipped", False) and optimizer is self._first_optimizer():
                self._optimizer_steps += 1
            return out

        optimizer.step = counted
        optimizer._persist_counted = True

    def _first_optimizer(self) -> Any:
        optimizers = self._accelerator._optimizers if self._accelerator is not None else []
        return optimizers[0] if optimizers else None

    # ------------------------------------------------------------------ save / load

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by :meth:`resume`); the step of the next save."""
        return self._optimizer_steps

    def _engine_or_raise(self) -> CheckpointEngine:
        if self._engine is None:
            raise ConfigError("PersistHook is not registered; call hook.register(accelerator) first")
        return self._engine

    def _save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **_: Any) -> str:
        engine = self._engine_or_raise()
        self._log_finished()
        acc = self._accelerator
        state = {
            "models": [acc.get_state_dict(m, unwrap=False) for m in acc._models],
            "optimizers": [o.state_dict() for o in acc._optimizers],
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "dataloaders": [_dataloader_state(dl) for dl in acc._dataloaders],
            "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "per_process": _gather(acc, {"rng": _rng_state(), "step": acc.step}),
            "optimizer_steps": self._optimizer_steps,
            "iteration": acc.project_configuration.iteration,
        }
        path = str(engine.local_dir / checkpoint_dirname(self._optimizer_steps))
        if self._optimizer_steps in self._saved:
            log.info("save_state(): step %d is saved already (no optimizer step since); nothing to do", self._optimizer_steps)
            return path
        try:
            handle = engine.save(state, self._optimizer_steps, metadata={"saved_by": "accelerate_persist"})
        except StepExistsError as e:
            raise ConfigError(
                f"step {self._optimizer_steps} is already committed in {self._local_dir} by an earlier run; resume it "
                "with hook.resume() before training, or give this run its own local_dir (committed checkpoints are "
                "never overwritten)"
            ) from e
        self._saved.add(self._optimizer_steps)
        self._unlogged.append(handle)
        acc.project_configuration.iteration += 1
        if output_dir is not None:
            log.info("save_state(%r): the checkpoint is %s (PersistHook writes to local_dir)", output_dir, path)
        return path

    def _load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **_: Any) -> None:
        engine = self._engine_or_raise()
        engine.wait()
        state = engine.load(None if input_dir is None else engine.reader.step_of(input_dir))
        self._apply(state)

    def _apply(self, state: dict[str, Any]) -> None:
        acc = self._accelerator
        counts = {"models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
                  "custom": len(acc._custom_objects)}
        for key, n in counts.items():
            if len(state[key]) != n:
                raise ConfigError(
                    f"the checkpoint holds {len(state[key])} {key} but this Accelerator has {n}; restore into the same "
                    "set of prepared objects (and register_for_checkpointing calls) that saved it"
                )
        for model, weights in zip(acc._models, state["models"]):
            model.load_state_dict(_match_wrapping(weights, model))
        for optimizer, optim_state in zip(acc._optimizers, state["optimizers"]):
            optimizer.load_state_dict(optim_state)
        for scheduler, sched_state in zip(acc._schedulers, state["schedulers"]):
            scheduler.load_state_dict(sched_state)
        for dataloader, dl_state in zip(acc._dataloaders, state["dataloaders"]):
            _restore_dataloader(dataloader, dl_state)
        if acc.scaler is not None and state["scaler"] is not None:
            acc.scaler.load_state_dict(state["scaler"])
        for obj, obj_state in zip(acc._custom_objects, state["custom"]):
            obj.load_state_dict(obj_state)
        per_process = state["per_process"]
        mine = per_process[acc.process_index] if acc.process_index < len(per_process) else per_process[0]
        if acc.process_index >= len(per_process):
            log.warning("the checkpoint has RNG states for %d processes; process %d takes process 0's",
                        len(per_process), acc.process_index)
        _set_rng_state(mine["rng"])
        acc.step = mine["step"]
        acc.project_configuration.iteration = state["iteration"] + 1
        self._optimizer_steps = state["optimizer_steps"]
        self._saved.add(self._optimizer_steps)  # restored from it: saving again at this step is a no-op

    def resume(self) -> int:
        """Restore the newest committed checkpoint (local, else remote) into the Accelerator.

        Returns:
            Its step (optimizer steps taken), or 0 when there is no checkpoint yet.
        """
        try:
            self._load_state()
        except CheckpointNotFoundError:
            log.info("no checkpoint in %s%s: starting at step 0", self._local_dir,
                     f" or {self._remote_url}" if self._remote_url else "")
            return 0
        return self._optimizer_steps

    def maybe_save(self) -> bool:
        """Save if the ``save_policy`` (or a preemption notice) says so; every process calls this.

        The decision is agreed across processes (the main process's policy; a preemption notice
        on any process counts for all), so no process waits for a save the others skipped.

        Returns:
            Whether it saved. After a preemption notice, :attr:`preempted` is True.

        Raises:
            ConfigError: no ``save_policy`` was given.
        """
        engine = self._engine_or_raise()
        if self._save_policy is None:
            raise ConfigError("maybe_save() needs PersistHook(save_policy=...), e.g. Continuous(min_interval_s=30)")
        decision, preempting = engine.decide(self._optimizer_steps)  # agreed across processes
        if decision:
            self._save_state()
        if preempting:
            engine.finish_preemption()
        return decision

    @property
    def preempted(self) -> bool:
        """A preemption notice arrived and its checkpoint is committed (and uploaded): stop the loop."""
        return self._engine is not None and self._engine.preempted

    def latest(self) -> str | None:
        """The newest committed checkpoint's path or URL, or ``None``."""
        with CheckpointReader(self._local_dir, remote_url=self._remote_url, storage_options=self._storage_options) as r:
            info = r.latest()
        return None if info is None else info.path

    # ------------------------------------------------------------------ flush

    def wait(self) -> None:
        """Block until pending saves are committed and uploaded; raises a background failure once."""
        self._engine_or_raise().wait()
        self._log_finished()

    def close(self) -> None:
        """Drain, then give the Accelerator its own ``save_state``/``load_state`` back. Idempotent."""
        if self._accelerator is None:
            return
        engine, acc = self._engine, self._accelerator
        try:
            if engine is not None:
                log.info("torch-persist: %s", describe_summary(engine.summary()))
                engine.close()
        finally:
            self._log_finished()
            for name, original in self._originals.items():
                setattr(acc, name, original)
            if self._notice is not None:
                self._notice.restore()
                self._notice = None
            if self._restore_signal is not None:
                self._restore_signal()
                self._restore_signal = None
            self._accelerator, self._engine, self._originals = None, None, {}

    def __enter__(self) -> PersistHook:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _end_training(self) -> None:
        self.wait()
        self._originals["end_training"]()

    def _log_finished(self) -> None:
        """Report finished saves through ``accelerator.log`` (when trackers are set) and the log."""
        done = [h for h in self._unlogged if h.done()]
        self._unlogged = [h for h in self._unlogged if not h.done()]
        acc = self._accelerator
        for handle in done:
            s = handle.stats
            log.info("[step=%d] stall %.3f s, write %.2f GB/s", s.step, s.stall_s, s.write_gbps or 0.0)
            if acc is not None and getattr(acc, "trackers", None):
                acc.log(s.metrics(), step=s.step)


# ---------------------------------------------------------------------- state pieces


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather(accelerator: Any, value: Any) -> list[Any]:
    """Every process's ``value``, in process order (the same list on every process)."""
    if accelerator.num_processes == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(out, value)
    return out


def _dataloader_state(dataloader: Any) -> dict[str, Any]:
    """What Accelerate saves for a dataloader: a seedable sampler, and a stateful loader's state."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    state: dict[str, Any] = {"sampler": None, "state_dict": None}
    if isinstance(dataloader.dataset, IterableDatasetShard):
        sampler = dataloader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            state["sampler"] = sampler
    if getattr(dataloader, "use_stateful_dataloader", False):
        state["state_dict"] = dataloader.state_dict()
    return state


def _restore_dataloader(dataloader: Any, state: dict[str, Any]) -> None:
    if state["sampler"] is not None:
        dataloader.set_sampler(state["sampler"])
    if state["state_dict"] is not None and getattr(dataloader, "use_stateful_dataloader", False):
        dataloader.load_state_dict(state["state_dict"])


def _match_wrapping(weights: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Saved by DDP (``module.`` keys) and loaded without it, or the other way round: rename."""
    have, want = set(weights), set(model.state_dict())
    if have == want:
        return weights
    if all(k.startswith("module.") for k in have) and {k[len("module."):] for k in have} == want:
        return type(weights)((k[len("module."):], v) for k, v in weights.items())
    if {f"module.{k}" for k in have} == want:
        return type(weights)((f"module.{k}", v) for k, v in weights.items())
    return weights  # load_state_dict names what does not match
