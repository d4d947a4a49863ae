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
directory: the state is written once.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import _load as torch_load
from lightning.pytorch.callbacks import Callback

from persist_core import (
    AnyOf,
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointReader,
    Collectives,
    ConfigError,
    PersistError,
    RetentionContext,
    RetentionPolicy,
    SaveHandle,
    SaveStats,
    SingleProcess,
    StepExistsError,
)
from persist_core.decisions import SavePolicy, describe_summary
from persist_core.layout import checkpoint_dirname, parse_checkpoint_dirname
from persist_core.local_writer import fsync_dir
from persist_core.preemption import check_grace, drain_within, install_sigterm_flush
from persist_core.restore import CheckpointInfo
from persist_core.retention import policy_from_keywords

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _KeepLinked:
    """Keeps the steps that a live Lightning path names (``linked()`` is read at each decision)."""

    linked: Callable[[], set[int]]

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        live = self.linked()
        return [c.step in live for c in checkpoints]

    def __repr__(self) -> str:
        return "KeepLinkedByLightning()"


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


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

    Limits: FSDP with sharded state dicts and DeepSpeed write their own
    checkpoints and bypass any ``CheckpointIO``. ``ModelCheckpoint(dirpath=...)`` must be a local
    directory (the remote tier is ``remote_url``).

    Args:
        local_dir: directory of the local tier (created if missing), ideally on NVMe. Point
            ``ModelCheckpoint(dirpath=...)`` at it (or anywhere local: the paths are links).
        remote_url: an fsspec URL (``s3://bucket/run-7``, ``gs://``, ``file://``) committed
            checkpoints are uploaded to; ``None`` keeps them local.
        storage_options: passed to fsspec as-is (endpoint, credentials).
        keep_last: keep the newest N checkpoints on each tier.
        keep_every_n_steps: keep every checkpoint whose step is a multiple of N (milestones).
        keep_every_n_seconds: keep one checkpoint per N seconds of wall time.
        retention: a policy object instead of the three keywords.
        verify: check checksums on load (default True).
        max_pending: checkpoints staged or writing at once (each holds a host copy of the state).
        write_threads: threads writing one shard (default 4).
        preemption_grace_s: on SIGTERM, how long to wait for the pending checkpoint to commit and
            upload before the process goes on exiting (default 120 s; SIGKILL usually follows).

    Raises:
        ConfigError: a bad argument, an unwritable ``local_dir`` or an unusable ``remote_url``
            (checked when the first checkpoint is saved or loaded).
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
        write_threads: int | None = None,
        preemption_grace_s: float = 120.0,
    ) -> None:
        super().__init__()
        self._local_dir = Path(local_dir).expanduser().absolute()
        self._remote_url = remote_url
        self._storage_options = storage_options
        self._user_policy = policy_from_keywords(keep_last, keep_every_n_steps, keep_every_n_seconds, retention)
        self._grace_s = check_grace(preemption_grace_s)
        self._restore_signal: Any = None
        self._verify = verify
        self._max_pending = max_pending
        self._write_threads = write_threads
        self._lock = threading.Lock()
        self._engine: CheckpointEngine | None = None
        self._collectives: Collectives = SingleProcess()
        self._reader: CheckpointReader | None = None
        # Lightning path -> step: the step the path was last saved at (maybe still pending), and
        # the step its link on disk names now; retention keeps both
        self._intended: dict[str, int] = {}
        self._on_disk: dict[str, int] = {}
        self._scanned: set[str] = set()
        self._saved: dict[int, SaveHandle] = {}  # steps this plugin saved, and how
        self._unlogged: list[SaveHandle] = []
        self._link_errors: list[BaseException] = []
        self._summary: list[SaveStats] = []

    # ------------------------------------------------------------------ set-up

    @property
    def local_dir(self) -> Path:
        return self._local_dir

    def _linked_steps(self) -> set[int]:
        with self._lock:
            return set(self._intended.values()) | set(self._on_disk.values())

    def _adopt_links(self, directory: str) -> None:
        """Record the links an earlier run left in ``directory``, so their checkpoints stay."""
        if directory in self._scanned:
            return
        self._scanned.add(directory)
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.is_symlink():
                continue
            real = Path(os.path.realpath(entry.path))
            step = parse_checkpoint_dirname(real.name) if real.parent == Path(os.path.realpath(self._local_dir)) else None
            if step is not None and real.is_dir():
                with self._lock:
                    self._on_disk.setdefault(entry.path, step)

    def _get_engine(self) -> CheckpointEngine:
        if self._engine is None:
            linked = _KeepLinked(self._linked_steps)
            local = linked if self._user_policy is None else AnyOf(self._user_policy, linked)
            remote = None if self._user_policy is None or self._remote_url is None else AnyOf(self._user_policy, linked)
            self._engine = CheckpointEngine(
                self._local_dir, remote_url=self._remote_url, storage_options=self._storage_options,
                keep_local=local, keep_remote=remote, verify=self._verify, max_pending=self._max_pending,
                write_threads=self._write_threads, collectives=self._collectives,
            )
        return self._engine

    def _use_collectives(self, collectives: Collectives) -> None:
        """Called by :class:`PersistDDPStrategy` on every rank: all ranks write from now on."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._collectives = collectives

    @property
    def _leader(self) -> bool:
        return self._collectives.rank == 0

    def _get_reader(self) -> CheckpointReader:
        if self._engine is not None:
            return self._engine.reader
        if self._reader is None:
            self._reader = CheckpointReader(self._local_dir, remote_url=self._remote_url,
                                            storage_options=self._storage_options, verify=self._verify)
        return self._reader

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
        self._raise_link_errors()
        target = self._path_key(path)
        if os.path.isdir(target) and not os.path.islink(target):
            raise ConfigError(f"checkpoint path {target!r} is an existing directory; remove it or choose another dirpath")
        trainer = self._log_finished()
        if trainer is None:
            self._install_sigterm_handler()
        self._adopt_links(str(self._local_dir))
        self._adopt_links(os.path.dirname(target))
        step = self._step_of(checkpoint)
        engine = self._get_engine()
        with self._lock:
            handle = self._saved.get(step)
        if handle is None:
            try:
                handle = engine.save(checkpoint, step, metadata={"lightning_path": os.path.basename(target)})
            except StepExistsError as e:
                raise ConfigError(
                    f"step {step} is already committed in {self._local_dir} by an earlier run, so {target!r} cannot be "
                    f"saved there; resume that run with trainer.fit(..., ckpt_path=io.latest_path()) or give this run "
                    "its own local_dir (committed checkpoints are never overwritten)"
                ) from e
            with self._lock:
                self._saved[step] = handle
                self._unlogged.append(handle)
        if not self._leader:
            return  # rank 0 names the checkpoint
        with self._lock:
            self._intended[target] = step
        handle.add_local_callback(lambda committed: self._on_committed(target, step, committed))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint ``path`` names, on the CPU unless ``map_location`` says otherwise.

        ``path`` may be a path this plugin saved (a link), a ``local_dir/step-N`` directory, a
        ``remote_url/step-N`` URL (downloaded into ``local_dir`` and verified), or a plain
        ``torch.save`` file (loaded with ``torch.load``, for runs started with another IO).
        Non-tensor values (hyper-parameters, loop state) are unpickled, as with
        ``torch.load(weights_only=False)``: load checkpoints you trust.

        Raises:
            CheckpointNotFoundError: nothing there (a ``FileNotFoundError``).
            CorruptCheckpointError: the checkpoint does not verify.
        """
        text = os.fspath(path)
        if not _is_url(text):
            text = self._path_key(text)
            with self._lock:
                step = self._intended.get(text)
                handle = None if step is None else self._saved.get(step)
            if handle is not None:  # saved by this plugin: wait for it, if need be, and read that step
                handle.wait_local()
                return self._get_reader().load(step, map_location=_device(map_location))
            if os.path.isfile(text):
                return torch_load(text, map_location=map_location or "cpu", weights_only=weights_only)
            self._adopt_links(os.path.dirname(text))
            if not os.path.lexists(text):
                raise CheckpointNotFoundError(f"checkpoint {text!r} does not exist")
        reader = self._get_reader()
        real = Path(os.path.realpath(text)) if not _is_url(text) else None
        if real is not None and real.parent != Path(os.path.realpath(reader.local_dir)):
            with CheckpointReader(real.parent, verify=self._verify) as other:  # another run's local_dir
                return other.load(other.step_of(real), map_location=_device(map_location))
        return reader.load(reader.step_of(text), map_location=_device(map_location))

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the path; its directory goes when no path links to it and retention lets it.

        A path whose save is still being written is never linked afterwards. A plain file at
        ``path`` (from another IO) is deleted.
        """
        target = self._path_key(path)
        with self._lock:
            self._intended.pop(target, None)
            self._on_disk.pop(target, None)
            if os.path.islink(target):
                os.unlink(target)
            elif os.path.isfile(target):
                os.remove(target)
        log.debug("removed %s", target)

    def teardown(self) -> None:
        """Wait until every save is committed and uploaded, prune, log a summary; raises a failure once.

        After a SIGTERM the wait is bounded by ``preemption_grace_s``: what is not uploaded by
        then is logged (its local copy is committed, and the next run uploads it).
        """
        engine, self._engine = self._engine, None
        reader, self._reader = self._reader, None
        if self._restore_signal is not None:
            self._restore_signal()
            self._restore_signal = None
        if reader is not None:
            reader.close()
        trainer = _find_trainer()
        if engine is None:
            _warn_if_bypassed(trainer)
            self._raise_link_errors()
            return
        preempted = bool(getattr(trainer, "received_sigterm", False))
        try:
            if preempted and not drain_within(engine.wait, self._grace_s):
                return  # the process is going down; the engine's exit hook goes on uploading while it can
            try:
                engine.wait()
                engine.prune()
            finally:
                log.info("torch-persist: %s", describe_summary(engine.summary()))
                engine.close()
        finally:
            self._log_finished()
            self._log_summary()
        self._raise_link_errors()

    def autosave(self, policy: SavePolicy, filename: str = "autosave.ckpt") -> Callback:
        """A callback that saves when ``policy`` says so (and at a SIGTERM), through this plugin.

        Example: ``Trainer(plugins=[io], callbacks=[io.autosave(Continuous(min_interval_s=30))])``.
        The newest autosave is ``local_dir/autosave.ckpt``; retention (``keep_last`` ...) decides
        what else stays.
        """
        from lightning_persist.autosave import PersistAutoSave

        return PersistAutoSave(self, policy, filename)

    # ------------------------------------------------------------------ resume

    def latest_path(self) -> str | None:
        """The newest committed checkpoint, for ``trainer.fit(model, ckpt_path=io.latest_path())``.

        A local ``step-N`` directory when ``local_dir`` has one, else the ``remote_url`` URL of
        the newest remote checkpoint (downloaded when loaded), else ``None`` (a first run).
        """
        info = self._get_reader().latest()
        return None if info is None else info.path

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _path_key(path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        if text.startswith("file://"):
            text = text[len("file://") :]
        if _is_url(text):
            raise ConfigError(
                f"checkpoint path {text!r} is remote; PersistCheckpointIO writes to local_dir and uploads to remote_url, "
                "so point ModelCheckpoint(dirpath=...) at a local directory and pass the URL as remote_url"
            )
        return os.path.abspath(text)

    def _step_of(self, checkpoint: dict[str, Any]) -> int:
        for key in ("global_step", "step"):
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        # Fabric states without a step: one past everything known
        with self._lock:
            saved = max(self._saved, default=-1)
        committed = max((c.step for c in self._get_reader().list()), default=-1)
        return max(saved, committed) + 1

    def _on_committed(self, target: str, step: int, committed: bool) -> None:
        """Writer thread: link ``target`` to the committed directory, unless it was removed meanwhile."""
        with self._lock:
            if self._intended.get(target) != step:
                return
            if not committed:
                del self._intended[target]
                return
            try:
                _link(target, self._local_dir / checkpoint_dirname(step))
                self._on_disk[target] = step
            except OSError as e:
                error = PersistError(f"checkpoint step={step} is committed, but linking {target!r} to it failed: {e}")
                log.error("%s", error)
                self._link_errors.append(error)

    def _install_sigterm_handler(self) -> None:
        """Without a Trainer (Fabric): on SIGTERM, flush within the grace period, then chain."""
        if self._restore_signal is None:
            self._restore_signal = install_sigterm_flush(
                lambda: None if self._engine is None else self._engine.wait, self._grace_s)

    def _raise_link_errors(self) -> None:
        with self._lock:
            errors, self._link_errors = self._link_errors, []
        if errors:
            raise errors[0]

    def _log_finished(self) -> Any | None:
        """Send the stats of saves that finished to the Trainer's loggers (on the training thread).

        Returns the Trainer on the call stack, if any.
        """
        with self._lock:
            done = [h for h in self._unlogged if h.done()]
            self._unlogged = [h for h in self._unlogged if not h.done()]
        trainer = _find_trainer()
        for handle in done:
            stats = handle.stats
            self._summary.append(stats)
            log.info("[step=%d] stall %.3f s, write %.2f GB/s, upload %s GB/s, lag %s s", stats.step, stats.stall_s,
                     stats.write_gbps or 0.0, _fmt(stats.upload_gbps), _fmt(stats.lag_s))
            if trainer is not None:
                for logger in trainer.loggers:
                    logger.log_metrics(stats.metrics(), step=stats.step)
        return trainer

    def _log_summary(self) -> None:
        if not self._summary:
            return
        n = len(self._summary)
        stall = sorted(s.stall_s for s in self._summary)
        log.info(
            "torch-persist: %d checkpoints, stall median %.3f s max %.3f s, %.2f GB written%s",
            n, stall[n // 2], stall[-1], sum(s.nbytes for s in self._summary) / 1e9,
            "" if self._remote_url is None else f", synced to {self._remote_url}",
        )
        self._summary = []


def _device(map_location: Any) -> Any:
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, torch.device)):
        return map_location
    raise ConfigError(f"map_location={map_location!r} is not supported; pass None (CPU), a device string or a torch.device")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _link(target: str, ckpt_dir: Path) -> None:
    """Point ``target`` at ``ckpt_dir`` with one atomic rename of a fresh relative link."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.link-{secrets.token_hex(3)}")
    os.symlink(os.path.relpath(ckpt_dir, parent), tmp)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(Path(parent))


def _warn_if_bypassed(trainer: Any | None) -> None:
    """Say so when the Trainer's strategy wrote its own checkpoints around this plugin."""
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__
    sharded = name == "FSDPStrategy" and getattr(strategy, "_state_dict_type", "full") == "sharded"
    if name == "DeepSpeedStrategy" or sharded:
        log.error(
            "%s writes its own checkpoints and bypasses CheckpointIO plugins: PersistCheckpointIO wrote nothing "
            "(no local_dir, no remote_url, no retention). Use FSDPStrategy(state_dict_type='full') or DDP with it",
            name + ("(state_dict_type='sharded')" if sharded else ""),
        )


def _find_trainer() -> Any | None:
    """The Trainer whose ``save_checkpoint`` is on the call stack, to log through its loggers.

    ``CheckpointIO`` has no reference to its Trainer; Lightning calls it from
    ``Trainer.save_checkpoint`` a few frames up. ``None`` under Fabric or when called directly.
    """
    trainer_cls = sys.modules.get("lightning.pytorch.trainer.trainer")
    classes = [getattr(m, "Trainer", None) for m in (trainer_cls, sys.modules.get("pytorch_lightning.trainer.trainer"))]
    classes = tuple(c for c in classes if c is not None)
    if not classes:
        return None
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, classes):
            return candidate
        frame = frame.f_back
    return None
