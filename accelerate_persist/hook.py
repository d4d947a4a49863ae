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
:mod:`persist_core.save.commit`); per-process values (RNG states) are gathered so that every
checkpoint holds all of them.

The checkpoint's step is the number of optimizer steps taken (steps the GradScaler skipped, and
micro-batches of gradient accumulation, do not count) — what :meth:`PersistHook.resume` returns.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType
from typing import Any

from accelerate_persist import _state
from accelerate_persist._snapshots import StepSnapshots
from accelerate_persist._verify import ResumeCheck
from accelerate_persist._dirs import named_dir, newest_plain, optimizer_steps_of, plain_accelerate_dir
from persist_core import CheckpointNotFoundError, CheckpointReader, ConfigError, KeepLastN, SingleProcess
from persist_core import TorchCollectives
from persist_core.config import adapter_config, keyword_options
from persist_core.layout import checkpoint_dirname
from persist_core.links import Links
from persist_core.session import PersistSession

log = logging.getLogger(__name__)

_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")


@keyword_options("PersistHook")  # **keywords: the options of persist_core.config.ENTRY_POINTS, by name
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

    Limits: DDP/multi-CPU/single device, and FSDP2 (``fsdp_version=2``: sharded, each process writes
    and reads its own parts; it needs GPUs, so ``benchmarks/gpu_check.sh`` checks it). FSDP1,
    DeepSpeed, Megatron-LM and XLA save through their own machinery and are refused at ``register``. ``local_dir`` is one directory per node
    (node-local disks: each node commits its processes' files, the remote assembles the checkpoint) or
    one shared by all.

    Memory snapshots (``memory_every_n_steps``) are taken where the next step begins (see
    :mod:`accelerate_persist._snapshots`; no call in the loop) and :meth:`resume` restores the newest; without a
    ``save_policy``, only ``save_state()`` writes to disk.

    Args:
        local_dir: the local tier's directory (created if missing), ideally on NVMe.
        overlap: ``save_state()`` returns after copying what the forward may mutate (buffers, RNG and
            loader state); the prepared optimizers' parameters and state are copied in the background
            while the next forward and backward run, and each ``optimizer.step()`` waits for that copy
            (see ``CheckpointEngine.guard``). The checkpoint is the state at ``save_state()``.
    """

    def __init__(self, local_dir: str | os.PathLike[str], *, overlap: bool = False, **keywords: Any) -> None:
        self._options = adapter_config("PersistHook", local_dir, keywords)
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap={overlap!r} must be True or False")
        self._overlap = overlap
        self._guard: Any = None
        self._session: PersistSession | None = None
        self._accelerator: Any = None
        self._originals: dict[str, Any] = {}
        self._wrapped: list[tuple[Any, Any]] = []  # (optimizer, its own step) to put back on close
        self._snapshots: StepSnapshots | None = None  # memory_every_n_steps: a snapshot at the next forward
        self._check: ResumeCheck | None = None  # the resume check's pending part (at the next forward)
        self._optimizer_steps = 0
        self._links = Links(self._options.local_dir)  # directories named in save_state(dir); no policy: all kept

    # ------------------------------------------------------------------ registration

    def register(self, accelerator: Any) -> PersistHook:
        """Route ``accelerator.save_state``/``load_state`` through this hook (every process calls this).

        Raises:
            ConfigError: an unsupported distributed type, a ``total_limit`` that conflicts with
                the hook's retention, or a second registration.
        """
        if self._accelerator is not None:
            raise ConfigError("this PersistHook is registered already; close() it before registering it again")
        missing = [n for n in ("distributed_type", "num_processes", "save_state", "load_state", "project_configuration")
                   if not hasattr(accelerator, n)]
        if missing:
            raise ConfigError(f"register({type(accelerator).__name__}) needs an accelerate.Accelerator (it has no "
                              f"{', '.join(missing)}); pass the Accelerator you train with")
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
            raise ConfigError(
                f"WORLD_SIZE={launched} in the environment but the Accelerator runs 1 process: the launcher started "
                f"{launched} processes that do not know of each other (`accelerate launch --multi_gpu` on a machine "
                f"without GPUs does this), and each would write {self._options.local_dir} as if alone. Launch with "
                "`accelerate launch --cpu` (or Accelerator(cpu=True)) for one process group, or unset WORLD_SIZE"
            )
        if kind not in _SUPPORTED and not (kind == "FSDP" and _state.is_sharded(accelerator)):
            raise ConfigError(
                f"PersistHook does not support distributed_type={kind}: it saves through its own machinery; "
                f"use DDP, multi-CPU, one device ({', '.join(_SUPPORTED)}) or FSDP2 (FullyShardedDataParallelPlugin("
                "fsdp_version=2): its state is saved sharded)"
            )
        options = self._options
        config = accelerator.project_configuration
        if config.total_limit is not None:
            if options.keep_local is None:
                options = options.retaining(KeepLastN(config.total_limit))
                log.info("ProjectConfiguration(total_limit=%d) becomes keep_last=%d (applied after each commit)",
                         config.total_limit, config.total_limit)
            elif options.keep_local != KeepLastN(config.total_limit):
                raise ConfigError(
                    f"ProjectConfiguration(total_limit={config.total_limit}) conflicts with the hook's retention "
                    f"{options.keep_local!r}: set one of them (the hook applies retention after each commit)"
                )
        session = PersistSession(options, resume_hint="resume it with hook.resume() before training",
                                 release_hint="Here that is an earlier PersistHook on this local_dir: call "
                                              "hook.close() on it (or use `with hook.register(accelerator):`)",
                                 links=self._links)
        session.use_collectives(TorchCollectives.new_group() if accelerator.num_processes > 1 else SingleProcess())
        session.open(preemption=options.save_policy is not None)
        self._session, self._accelerator = session, accelerator
        self._originals = {name: getattr(accelerator, name) for name in ("save_state", "load_state", "end_training")}
        accelerator.save_state = self._save_state
        accelerator.load_state = self._load_state
        accelerator.end_training = self._end_training
        for optimizer in accelerator._optimizers:
            self._count_steps(optimizer)
        if options.memory is not None:
            self._snapshots = StepSnapshots(session, accelerator, options.memory, lambda: self._optimizer_steps)
        self._check = ResumeCheck(session, accelerator)
        session.install_flush()  # without a save policy: SIGTERM drains, then ends the process
        if self._overlap and accelerator._optimizers:  # the update after the next backward waits for the copy
            self._guard = session.open().guard(*[getattr(o, "optimizer", o) for o in accelerator._optimizers])
        return self

    def _count_steps(self, optimizer: Any) -> None:
        """Count the optimizer steps that happened (not accumulation micro-batches, not skipped steps)."""
        step = optimizer.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            syncing = getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True)
            if syncing and not getattr(optimizer, "step_was_skipped", False) and optimizer is self._first_optimizer():
                self._optimizer_steps += 1
            return out

        optimizer.step = counted
        self._wrapped.append((optimizer, step))

    def _first_optimizer(self) -> Any:
        optimizers = self._accelerator._optimizers if self._accelerator is not None else []
        return optimizers[0] if optimizers else None

    # ------------------------------------------------------------------ save / load

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by :meth:`resume`); the step of the next save."""
        return self._optimizer_steps

    def _session_or_raise(self) -> PersistSession:
        if self._session is None:
            raise ConfigError("PersistHook is not registered; call hook.register(accelerator) first")
        return self._session

    def _save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **_: Any) -> str:
        """``save_state()``: the checkpoint goes to ``local_dir/step-N``; a directory the user names
        (``output_dir``, or ``ProjectConfiguration``'s ``checkpoints/checkpoint_<iteration>``) becomes a
        link to it once it is committed. Returns that directory, else the ``step-N`` path."""
        session = self._session_or_raise()
        self._report()
        acc = self._accelerator
        step = self._optimizer_steps
        path = str(self._options.local_dir / checkpoint_dirname(step))
        named, automatic = named_dir(acc, output_dir, self._options.local_dir)
        if session.saved(step):
            log.info("save_state(): step %d is saved already (no optimizer step since); nothing more to write", step)
            handle = session.handle(step)
        else:
            state = _state.capture(acc, optimizer_steps=step)
            handle = session.save(state, step, metadata={"saved_by": "accelerate_persist"})
            acc.project_configuration.iteration += 1
        if named is not None and session.leader:  # kept by retention while the link is there (unless automatic)
            session.link(named, step, handle, automatic=automatic)  # restored from this step (no handle): now
        return named or path

    def _load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """``load_state()``: the newest committed checkpoint, or the one ``input_dir`` names (a directory
        ``save_state`` named, ``local_dir/step-N``, a URL). A plain Accelerate checkpoint (no manifest: a
        run switching to the hook) loads through Accelerate's own loader. Non-tensor values are unpickled
        with the allowlist of the types training states hold unless ``load_kwargs={"weights_only": False}``
        (full pickle: for checkpoints you trust)."""
        session = self._session_or_raise()
        engine = session.open()
        engine.wait()
        acc = self._accelerator
        plain = None
        if input_dir is not None:
            plain = plain_accelerate_dir(os.fspath(input_dir))
        elif acc.project_configuration.automatic_checkpoint_naming and not engine.list("all"):
            plain = newest_plain(os.path.join(acc.project_dir, "checkpoints"))
        if plain is not None:
            self._originals["load_state"](plain, load_kwargs=load_kwargs, **kwargs)
            self._optimizer_steps = optimizer_steps_of(acc)
            log.info("loaded %s with Accelerate's own loader (not a torch-persist checkpoint); %d optimizer steps",
                     plain, self._optimizer_steps)
            return
        weights_only = (load_kwargs or {}).get("weights_only", True)  # Accelerate passes it on to torch.load
        state = engine.load(None if input_dir is None else engine.reader.step_of(input_dir),
                            into=_state.load_targets(acc),  # FSDP2: each process reads its own parts
                            weights_only=weights_only)
        self._optimizer_steps = _state.apply(acc, state)
        session.restored(self._optimizer_steps)  # saving again at this step is a no-op
        if self._snapshots is not None:
            self._snapshots.restored()
        if self._check is not None:  # the RNG and data now, the rest at the first forward (accelerate_persist._verify)
            self._check.restored(self._optimizer_steps, len(state["per_process"]))

    def resume(self) -> int:
        """Restore the newest committed checkpoint (local, else remote) into the Accelerator.

        Returns:
            Its step (optimizer steps taken), or 0 when there is no checkpoint yet.
        """
        try:
            self._load_state()
        except CheckpointNotFoundError:
            log.info("no checkpoint in %s%s: starting at step 0", self._options.local_dir,
                     f" or {self._options.remote_url}" if self._options.remote_url else "")
            return 0
        return self._optimizer_steps

    def maybe_save(self) -> bool:
        """Save if the ``save_policy`` (or a preemption notice) says so; every process calls this.

        The decision is agreed across processes (the main process's policy; a preemption notice
        on any process counts for all), so no process waits for a save the others skipped.

        Returns:
            Whether it saved. After a preemption notice, :attr:`preempted` is True.

        Raises:
            ConfigError: neither a ``save_policy`` nor ``memory_every_n_steps`` was given.
        """
        session, step, memory = self._session_or_raise(), self._optimizer_steps, self._options.memory
        engine = session.open()
        if self._options.save_policy is None and memory is None:
            raise ConfigError("maybe_save() needs PersistHook(save_policy=...), e.g. Continuous(min_interval_s=30), "
                              "or memory_every_n_steps=...")
        decision, preempting = engine.decide(step)  # agreed across processes
        if decision:
            self._save_state()
        if self._snapshots is not None:
            self._snapshots.offer(step)
        if preempting:
            engine.finish_preemption()
        return decision

    @property
    def preempted(self) -> bool:
        """A preemption notice arrived and its checkpoint is committed (and uploaded): stop the loop."""
        engine = None if self._session is None else self._session.engine
        return engine is not None and engine.preempted

    def latest(self) -> str | None:
        """The newest committed checkpoint's path or URL, or ``None`` (reads only, on any credentials)."""
        o = self._options
        with CheckpointReader(o.local_dir, remote_url=o.remote_url, storage_options=o.storage_options,
                              memory=o.memory, remote_encryption_key=o.remote_encryption_key) as r:
            info = r.latest()
        return None if info is None else info.path

    # ------------------------------------------------------------------ flush

    def wait(self) -> None:
        """Block until pending saves are committed and uploaded; raises a background failure once."""
        self._session_or_raise().open().wait()
        self._report()

    def close(self, *, _failed: bool = False) -> None:
        """Drain, then give the Accelerator back everything ``register`` changed. Idempotent.

        Its own ``save_state``/``load_state``/``end_training``, each optimizer's own ``step``, and
        the signal handlers; so a new hook registered on the same Accelerator works as the first did.
        """
        if self._accelerator is None:
            return
        session, acc = self._session, self._accelerator
        try:
            if session is not None:
                session.close(sink=self._sink(), failed=_failed)
        finally:
            if self._guard is not None:
                self._guard.remove()
                self._guard = None
            if self._snapshots is not None:
                self._snapshots.remove()
                self._snapshots = None
            if self._check is not None:
                self._check.remove()
                self._check = None
            for name, original in self._originals.items():
                setattr(acc, name, original)
            for optimizer, step in reversed(self._wrapped):
                optimizer.step = step
            self._accelerator, self._session, self._originals, self._wrapped = None, None, {}, []

    def __enter__(self) -> PersistHook:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(_failed=exc is not None)  # a failed run keeps its memory snapshots for the restart

    def _end_training(self) -> None:
        self.wait()
        self._originals["end_training"]()

    def _sink(self) -> Any:
        acc = self._accelerator
        if acc is None or not getattr(acc, "trackers", None):
            return None
        return lambda metrics, step: acc.log(metrics, step=step)

    def _report(self) -> None:
        """Report finished saves through ``accelerator.log`` (when trackers are set) and the log."""
        if self._session is not None:
            self._session.report(self._sink())

