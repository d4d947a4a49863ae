"""``PersistCheckpointIO``: Lightning's ``CheckpointIO`` contract on top of the torch-persist engine.

Who calls what (``lightning.pytorch`` 2.x): the Trainer's strategy calls ``save_checkpoint`` and
``remove_checkpoint`` on global rank 0 (``ModelCheckpoint`` decides the paths), ``load_checkpoint``
on every rank, and ``teardown`` on every rank when ``fit``/``validate``/``test`` ends.

How a Lightning path maps to a checkpoint: each save is one engine checkpoint, a directory
``local_dir/step-NNNNNNNNNNNN`` keyed by the Trainer's ``global_step``. The path Lightning asked
for (``dirpath/epoch=0-step=50.ckpt``, ``dirpath/last.ckpt``) becomes a relative symbolic link to
that directory, created (or atomically replaced, with one ``rename``) once the checkpoint is
committed, so every path that exists loads and ``last.ckpt`` always names a committed checkpoint.
Two paths saved at one step (``ModelCheckpoint``'s top-k file and ``last.ckpt``) share one
directory: the state is written once. A weights-only save (``save_weights_only=True``) is a
checkpoint of another kind, ``local_dir/weights-only/step-N``, so a full and a weights-only save of
one step are two checkpoints (see :mod:`persist_core.layout`). A path saved again links to the newest
of its saves that committed (the older one until the newer commits), and the step a run resumed
from, saved again (gradient accumulation does), replaces the committed one atomically.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import _load as torch_load
from lightning.pytorch.callbacks import Callback

from lightning_persist._agree import agreed_step
from lightning_persist._memory import load_snapshot
from lightning_persist.snapshots import warn_without_entry_point
from lightning_persist._paths import device, kind_of, path_key, remote_path, restricted, shard_checkpoint
from lightning_persist._strategies import check_strategy
from lightning_persist._trainer import exit_as_sigterm, find_trainer, loggers_sink, rank_zero_info
from persist_core import CheckpointEngine, CheckpointNotFoundError, CheckpointReader, Collectives, ConfigError
from persist_core.config import adapter_config, keyword_options
from persist_core.layout import FULL, shard_filename
from persist_core.links import Links
from persist_core.load.paths import checkpoint_of
from persist_core.policies import SavePolicy
from persist_core.session import PersistSession

log = logging.getLogger(__name__)


@keyword_options("PersistCheckpointIO")  # **keywords: the options of persist_core.config.ENTRY_POINTS, by name
class PersistCheckpointIO(CheckpointIO):
    """Asynchronous, verified, remotely synced checkpoints for the Lightning ``Trainer`` and ``Fabric``.

    Example::

        io = PersistCheckpointIO(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7",
                                 keep_last=3, keep_every_n_steps=1000)
        trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="/nvme/ckpt", every_n_train_steps=50,
                                                                   save_last=True)])
        trainer.fit(model, ckpt_path=io.latest_path())   # None on a first run; remote on a fresh machine

    ``save_checkpoint`` returns once the state is copied to host memory; writing, committing,
    uploading and retention go on in the background. ``teardown`` (called by the Trainer when
    ``fit`` ends) waits for all of it and raises a background failure, once.

    Retention: ``ModelCheckpoint`` decides which of *its* paths exist (``save_top_k``,
    ``save_last``); a checkpoint directory stays while a path links to it. On top of that,
    ``keep_last``/``keep_every_n_steps``/``keep_every_n_seconds`` (or ``retention``) keep
    checkpoints on both tiers even after ``ModelCheckpoint`` removed their path: milestones are
    protected from ``save_top_k`` removals; load one with ``io.load_checkpoint(local_dir/step-N)``
    or the ``persist`` command. The remote keeps everything unless one of those is given. A
    directory is deleted only after a newer checkpoint is committed, never while it is written or
    uploaded, and never the newest one.

    Preemption: under the Trainer, Lightning's own SIGTERM handling stops training at the next
    batch and calls ``teardown``, which commits and uploads what is pending within
    ``preemption_grace_s``; SLURM's requeue signal saves through this plugin like any checkpoint.
    Without a Trainer (Fabric), the plugin installs a SIGTERM handler that waits (no I/O of its
    own) for the pending checkpoint and upload within the grace period, then runs the previous
    handler (by default: the process ends as SIGTERM would end it).

    DDP: Lightning calls a ``CheckpointIO`` on rank 0 only, so with ``strategy="ddp"`` rank 0
    writes the whole state. ``strategy=PersistDDPStrategy()`` makes every rank write about
    ``1/world_size`` of it (rank 0 commits once all succeeded). Every rank can load either.

    Limits: ``ModelParallelStrategy``, ``FSDPStrategy`` and ``DeepSpeedStrategy`` save or load their
    own checkpoints around any ``CheckpointIO``; the plugin says so once (a
    :class:`StrategyBypassWarning`), and refuses with a ``ConfigError`` the ones that would save
    through it but could not resume from what it saved. ``ModelCheckpoint(dirpath=...)`` must be a
    local directory (the remote tier is ``remote_url``).

    Start over, incremental saves, memory snapshots: a ``fit`` that resumes nothing on a ``remote_url`` holding
    another run's checkpoints is refused before its first batch (resume with ``ckpt_path=io.latest_path()``: on a
    fresh machine Lightning's ``"last"`` finds no local file; or pass ``start_over=True``). Full checkpoints stay
    files ``torch.load`` reads; an ``incremental`` one that references another is not: load it with
    ``fit(ckpt_path=...)``, :func:`~lightning_persist.load_from_checkpoint` or ``persist export``. The memory
    snapshots of ``memory_every_n_steps`` are taken by a callback Lightning adds to every Trainer through the
    package's entry point; ``ckpt_path=io.latest_path()`` names the newest, while ``last.ckpt`` and
    ``ModelCheckpoint``'s files keep naming disk checkpoints; several processes snapshot with ``PersistDDPStrategy``.

    Args:
        local_dir: the local tier's directory (created if missing), ideally on NVMe. Point ``ModelCheckpoint(dirpath=...)`` at it (or anywhere local: the
            paths are links).
        exit_after_sigterm: after a SIGTERM stopped the Trainer and ``teardown`` flushed, exit with
            status 143 as SIGTERM would (default); ``False`` lets ``fit`` return (Lightning exits 0).

    Raises:
        ConfigError: a bad argument, an unwritable ``local_dir`` or an unusable ``remote_url``
            (checked when the first checkpoint is saved or loaded).
    """

    def __init__(self, local_dir: str | os.PathLike[str], *, exit_after_sigterm: bool = True,
                 **keywords: Any) -> None:
        super().__init__()
        self._exit_after_sigterm = exit_after_sigterm
        self._strategy_seen = False  # the Trainer's strategy was checked (a CheckpointIO has no set-up hook)
        self._memory_refusal_said = False  # a strategy that cannot snapshot was said (lightning_persist.snapshots)
        self._resume_loaded = False  # the last load went through the full engine's reader (lightning_persist.verify)
        options = adapter_config("PersistCheckpointIO", local_dir, keywords, torch_loadable=True)
        # ModelCheckpoint decides which paths exist: with no retention policy, what they link to is what stays
        self._links = Links(options.local_dir, file_name=shard_filename(0, torch_zip=True), retain_only_linked=True)
        self._session = PersistSession(
            options, resume_hint="resume that run with trainer.fit(..., ckpt_path=io.latest_path())",
            release_hint="Here that is an earlier PersistCheckpointIO on this local_dir: call io.teardown() on it (a "
                         "Trainer's fit does; after trainer.save_checkpoint() outside fit, io.wait() only flushes)",
            links=self._links)
        if options.memory is not None:
            warn_without_entry_point()

    # ------------------------------------------------------------------ set-up

    @property
    def local_dir(self) -> Path:
        return self._session.options.local_dir

    def _get_engine(self, kind: str = FULL) -> CheckpointEngine:
        """The engine of ``kind``; the full one is opened first, as every kind needs it."""
        return self._session.open_kind(kind)

    def _use_collectives(self, collectives: Collectives) -> None:
        """Called by :class:`PersistDDPStrategy` on every rank: all ranks write from now on."""
        self._session.use_collectives(collectives)

    @property
    def _leader(self) -> bool:
        return self._session.leader

    def _get_reader(self) -> CheckpointReader:
        return self._session.reader

    # ------------------------------------------------------------------ the CheckpointIO contract

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and return; ``path`` links to it once it is committed.

        Raises:
            TypeError: ``storage_options`` given (the remote's options go to the constructor).
            ConfigError: ``path`` is a URL or an existing directory that is not a link; or its
                step is already committed in ``local_dir`` by another run.
        """
        if storage_options is not None:
            raise TypeError(
                f"save_checkpoint(..., storage_options={storage_options!r}) is not supported by PersistCheckpointIO; "
                "pass storage_options=... to PersistCheckpointIO(...) for the remote tier"
            )
        self._links.raise_errors()
        target = path_key(path)
        if os.path.isdir(target) and not os.path.islink(target):
            raise ConfigError(f"checkpoint path {target!r} is an existing directory; remove it or choose another dirpath")
        trainer = self._trainer()
        self._session.report(loggers_sink(trainer))
        if trainer is None:
            self._session.install_flush()
        self._links.adopt(str(self.local_dir))
        self._links.adopt(os.path.dirname(target))
        step = self._step_of(checkpoint)
        kind = kind_of(checkpoint)
        self._get_engine(kind)
        handle = self._session.save(checkpoint, step, kind=kind,
                                    metadata={"lightning_path": os.path.basename(target), "kind": kind})
        if not self._leader or handle is None:
            return  # rank 0 names the checkpoint
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)  # save_last="link" links in it right away
        self._session.link(target, step, handle, kind)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None, *, into: Any = None) -> dict[str, Any]:
        """Load the checkpoint ``path`` names, on the CPU unless ``map_location`` says otherwise.

        ``into``: sharded targets to fill in place (``PersistModelParallelStrategy`` passes the model's
        and optimizers' state dicts on the new mesh); each rank reads only what its parts need.

        ``path`` may be a path this plugin saved (a link), a ``local_dir/step-N`` directory, a
        ``remote_url/step-N`` URL (streamed and verified; a local copy lands in ``local_dir``), or a plain
        ``torch.save`` file (loaded with ``torch.load``, for runs started with another IO).
        Non-tensor values (hyper-parameters, loop state) are unpickled as ``torch.load`` does by default:
        only the types training states hold (``weights_only=None`` or ``True``); a checkpoint holding
        other types raises ``UnsafeCheckpointError`` naming the type, and loads with
        ``weights_only=False`` (``Trainer.fit(..., weights_only=False)``) if you trust it.

        Raises:
            CheckpointNotFoundError: nothing there (a ``FileNotFoundError``).
            CorruptCheckpointError: the checkpoint does not verify.
        """
        self._trainer()
        self._resume_loaded = False

        def read(reader: CheckpointReader, step: int) -> dict[str, Any]:
            state = reader.load(step, map_location=device(map_location), into=into, rank=self._rank,
                                weights_only=restricted(weights_only))
            self._resume_loaded = reader is self._get_reader()  # what the engine's verify_resume compares with
            return state

        text = os.fspath(path)
        snapshot = load_snapshot(self._session, text, into=into, map_location=device(map_location),
                                 weights_only=restricted(weights_only))
        if snapshot is not None:  # io.latest_path() named a memory snapshot (rank 0's, with several ranks)
            self._resume_loaded = True
            return snapshot
        agreed = agreed_step(self._session, self._links, self._get_reader, text)
        if agreed is not None:  # several ranks: every one loads the step rank 0's path names, from its own tiers
            return read(self._reader_of(agreed[0]), agreed[1])
        if not remote_path(text, self._session.options.remote_url):
            text = path_key(text)
            key = self._links.intended(text)
            handle = None if key is None else self._session.handle(key[1], key[0])
            if handle is not None and key is not None:  # saved by this plugin: wait for it, if need be, and read it
                handle.wait_local()
                return read(self._reader_of(key[0]), key[1])
            if os.path.isfile(text) and shard_checkpoint(text) is None:  # a plain torch.save file
                return torch_load(text, map_location=map_location or "cpu", weights_only=weights_only)
            self._links.adopt(os.path.dirname(text))
            if not os.path.lexists(text):
                raise CheckpointNotFoundError(f"checkpoint {text!r} does not exist")
        reader = self._get_reader()
        real = checkpoint_of(Path(os.path.realpath(text))) if not remote_path(text, self._session.options.remote_url) else None
        if real is not None and real.parent != Path(os.path.realpath(reader.local_dir)):
            with CheckpointReader(real.parent, verify=self._session.options.verify) as other:  # another run's local_dir
                return read(other, other.step_of(real))
        return read(reader, reader.step_of(text))

    def _reader_of(self, kind: str) -> CheckpointReader:
        return self._get_reader() if kind == FULL else self._get_engine(kind).reader

    @property
    def _rank(self) -> int:
        return self._session.collectives.rank

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the path; its directory goes when no path links to it and retention lets it.

        A path whose save is still being written is never linked afterwards. A plain file or a
        directory at ``path`` that is not one of this plugin's checkpoints (another IO's, a strategy's
        own) is deleted, as the default IO deletes it.
        """
        self._trainer()
        target = path_key(path)
        if os.path.isdir(target) and not os.path.islink(target) and self._links.checkpoint_named(target) is None:
            shutil.rmtree(target)
        self._links.remove(target)
        log.debug("removed %s", target)

    def wait(self, timeout: float | None = None) -> None:
        """Flush: block until every pending save is written, committed, linked and uploaded.

        ``trainer.save_checkpoint(path)`` returns once the state is copied; after ``io.wait()`` the
        path exists and loads. Under Fabric (which never calls ``teardown``) call it before the
        script ends, or ``io.teardown()`` to also close. Raises a background failure once.

        Raises:
            TimeoutError: something is still pending after ``timeout`` seconds (it goes on).
            RemoteError: uploads still fail after ``remote_timeout_s`` (the steps stay on disk).
            PersistError: a save failed in the background (raised once).
        """
        try:
            self._session.wait(timeout)
        finally:
            self._links.raise_errors()

    def teardown(self) -> None:
        """Wait until every save is committed and uploaded, prune, then one summary; raises a failure once.

        After a SIGTERM the wait is bounded by ``preemption_grace_s``: what is not uploaded by
        then is logged (its local copy is committed, and the next run uploads it). Then, with
        ``exit_after_sigterm`` (the default), the process exits with status 143 (128 + SIGTERM), as
        SIGTERM would have ended it, instead of Lightning's 0 — so a scheduler sees a preemption.
        """
        trainer = self._trainer(refuse=False)
        preempted = bool(getattr(trainer, "received_sigterm", False))
        failed = preempted or bool(getattr(trainer, "interrupted", False))  # the memory snapshots stay for a restart
        try:
            self._session.close(preempted=preempted, sink=loggers_sink(trainer), announce=rank_zero_info,
                                failed=failed)
            self._links.sweep()
            self._links.raise_errors()
        finally:
            if preempted and self._exit_after_sigterm:
                exit_as_sigterm()

    def autosave(self, policy: SavePolicy | None, filename: str = "autosave.ckpt") -> Callback:
        """A callback that saves when ``policy`` says so (and at a SIGTERM), through this plugin; with
        ``memory_every_n_steps``, it also snapshots in memory at those steps (``policy=None``: memory only).

        Example: ``Trainer(plugins=[io], callbacks=[io.autosave(Continuous(min_interval_s=30))])``.
        The newest autosave is ``local_dir/autosave.ckpt``; retention (``keep_last`` ...) decides
        what else stays.
        """
        if policy is None and self._session.options.memory is None:
            raise ConfigError("io.autosave(None) saves nothing: pass a policy (Continuous(min_interval_s=30)) or "
                              "PersistCheckpointIO(memory_every_n_steps=1)")
        from lightning_persist.autosave import PersistAutoSave

        return PersistAutoSave(self, policy, filename)

    def overlap(self) -> Callback:
        """A callback that overlaps each save's copy of the parameters and optimizer state with the next
        forward and backward: ``save_checkpoint`` returns after copying the rest (module buffers such as
        BatchNorm's statistics, loop state), and the update after the next backward waits for the copy
        (``on_before_optimizer_step``). The checkpoint is the state at the save.

        Example: ``Trainer(plugins=[io], callbacks=[io.overlap(), ModelCheckpoint(...)])``.
        """
        from lightning_persist.autosave import PersistOverlap

        return PersistOverlap(self)

    # ------------------------------------------------------------------ resume

    def latest_path(self) -> str | None:
        """The newest committed full checkpoint, for ``trainer.fit(model, ckpt_path=io.latest_path())``.

        Weights-only saves (``save_weights_only=True``) are checkpoints of their own kind, in
        ``local_dir/weights-only``, and never the latest: they cannot resume training.

        A local ``step-N`` directory when ``local_dir`` has one, else the ``remote_url`` URL of
        the newest remote checkpoint (downloaded when loaded), else ``None`` (a first run). With
        ``memory_every_n_steps``, the newest memory snapshot's slot when it is newer than those (this plugin's
        ``load_checkpoint`` reads it).
        """
        info = self._get_reader().latest()
        return None if info is None else info.path

    # ------------------------------------------------------------------ internals

    def _step_of(self, checkpoint: dict[str, Any]) -> int:
        for key in ("global_step", "step", "iteration"):  # the Trainer's, a loop's, Fabric's docs' loop counter
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        # Fabric states without a step: one past everything known
        committed = max((c.step for c in self._get_reader().list()), default=-1)
        return max(self._session.newest_saved(), committed) + 1

    def _trainer(self, *, refuse: bool = True) -> Any | None:
        """The Trainer on the call stack (``None`` under Fabric or a direct call): the one place this plugin looks
        for it (a ``CheckpointIO`` holds no reference to it), checking its strategy until one was seen."""
        trainer = find_trainer()
        self._strategy_seen = check_strategy(trainer, self._strategy_seen, refuse=refuse)
        return trainer
