"""``CheckpointEngine``: the facade over one ``local_dir`` (and its remote), built by :func:`persist_core._build.build`
from a :class:`~persist_core.config.Config`: ``save`` is the save flow's, ``snapshot`` the memory tier's,
``maybe_save``/``decide``/preemption the scheduler's, ``wait``/``close`` the parts', ``list`` the load flow's,
``load``/``resume_from``/``verify_resume`` the :class:`~persist_core.resumption.Resumption`'s."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from persist_core import _knobs
from persist_core._build import build, close_at_exit
from persist_core.config import Config, keyword_options
from persist_core.distributed import Collectives
from persist_core.errors import PersistError
from persist_core.fileio import FileOps
from persist_core.format.manifest import Manifest
from persist_core.handle import SaveHandle
from persist_core.save.overlap import Guard
from persist_core.policies.save import Clock, DecisionContext, SavePolicy
from persist_core.load.reader import CheckpointReader
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


@keyword_options("CheckpointEngine")  # **keywords: every option of Config, shown by name with its docs
class CheckpointEngine:
    """Asynchronous, verified checkpoints of a PyTorch state on a local directory.

    Example::

        with CheckpointEngine(local_dir="/nvme/ckpt") as engine:
            for step in range(1, 10_001):
                train_step()
                if step % 100 == 0:
                    engine.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
        state = CheckpointReader("/nvme/ckpt").load()   # the newest committed checkpoint (no writer lock)

    Args:
        local_dir: directory of the local tier (created if missing; ideally on NVMe), or a whole :class:`Config`
            (then no options: ``CheckpointEngine(config.replace(...))``). The options, each below, build one.
        collectives: several processes' collectives (:class:`TorchCollectives`): every rank saves the same steps
            and writes about ``1/world_size`` of a state they hold alike (``DTensor`` leaves sharded; values that
            differ per rank on purpose in :class:`PerRank`); rank 0 commits, applies retention and uploads.
        clock: the monotonic clock decisions use (a fake in tests).
        wall_clock: the time manifests record.
        file_ops: the file system calls the writer makes (a fake in tests).

    Raises:
        ConfigError: a bad argument, or ``local_dir`` cannot be created or written.
        DirectoryInUseError: another live process writes ``local_dir`` for this rank (named); held until :meth:`close`.
    """

    def __init__(self, local_dir: str | os.PathLike[str] | Config, *, collectives: Collectives | None = None,
                 clock: Clock = time.monotonic, wall_clock: Clock = time.time, file_ops: FileOps | None = None,
                 **keywords: Any) -> None:
        self.config = config = Config.given(local_dir, keywords)
        self._closed = False
        p = self._parts = build(config, collectives=collectives, clock=clock, wall_clock=wall_clock, file_ops=file_ops,
                                wait=self.wait)
        self._root, self._coll, self._overlap, self._tier = p.root, p.coll, p.overlap, p.tier  # _tier: bench_remote
        self._scheduler, self._reader, self._resumption = p.scheduler, p.reader, p.resumption
        close_at_exit(self)

    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Snapshot ``state`` (nested dicts / lists / tuples of tensors and picklable values) as ``step`` and write
        it in the background; returns a handle once it is staged (the caller may then mutate ``state``). ``step``
        is a non-negative int not saved before in ``local_dir``, except the step this run resumed from
        (saving it again replaces it atomically, as a framework re-saving that step expects).

        Raises:
            ConfigError: a bad step, or this run loaded nothing and ``remote_url`` holds another run's committed
                checkpoints (resume with :meth:`load`, or pass ``start_over=True``).
            StepExistsError: ``step`` is already committed or pending.
            UnsupportedStateError: a leaf of ``state`` cannot be saved (its key path is named).
            PersistError: an earlier save failed in the background (raised once).
        """
        self._check_open()
        return self._parts.saver.save(state, step, metadata=metadata, resumed_at=self.resumed_step,
                                      lineage=self._resumption.lineage.record())

    def snapshot(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> None:
        """Copy ``state`` into the memory tier as ``step`` (nothing goes to disk); returns once it is copied. A
        restart on this machine resumes from it (``load()`` reads the freshest source). :meth:`maybe_save` calls
        it at the memory tier's steps; call it yourself to snapshot at steps of your choosing (with several nodes,
        such a snapshot goes to no partner: the partner copies are of the steps :meth:`maybe_snapshot` takes, which
        every rank calls at the same steps). Raises ``ConfigError`` without a ``memory`` tier, or for a bad step or
        metadata."""
        self._check_open()
        self._parts.memory.snapshot(state, step, metadata=metadata, resumed_at=self.resumed_step)

    def maybe_snapshot(self, make_state: Callable[[], Any], step: int, *,
                       metadata: dict[str, Any] | None = None) -> bool:
        """:meth:`snapshot` if the memory tier is due at ``step`` (building the state only then); whether it did.
        Without a memory tier (or once it ran out of room), nothing."""
        self._check_open()
        return self._parts.memory.maybe_snapshot(make_state, step, metadata=metadata, resumed_at=self.resumed_step)

    def wait_snapshot(self) -> None:
        """Until the newest memory snapshot is committed (its record written in the background; nothing without a
        memory tier). Call it before each optimizer update, as the adapters do: a kill after the update then loses
        that one step, not the one before it too."""
        self._parts.memory.wait_snapshot()

    def guard(self, *optimizers: Any, step_hook: bool = True) -> Guard:
        """Overlap the next saves with training: ``save()`` returns after copying what the forward pass may
        mutate; the optimizers' parameters and state are copied in the background during the next forward and
        backward, and each optimizer's next ``step()`` waits for that copy (a step pre-hook; while the step runs
        the background writes hold off). ``guard(...).remove()`` or ``with engine.guard(opt):`` undoes it.
        ``step_hook=False``: the caller calls :meth:`fence` itself before the update (Lightning, whose
        ``optimizer.step(closure)`` runs forward and backward inside). See the engine page of the docs.
        """
        return self._overlap.guard(optimizers, self.fence if step_hook else None)

    def fence(self) -> float:
        """Wait for the background copy of the last guarded save; the seconds waited. From here to the
        optimizer's step post-hook the background writes hold off (the update has the host's cores)."""
        return self._overlap.before_update()

    def after_update(self) -> None:
        """The guarded update is over: the background writes may use the cores again (the guard's post-hook
        calls it; call it where the announced step may not run, e.g. a ``GradScaler`` skipping it)."""
        self._overlap.turn.release()

    def maybe_save(self, make_state: Callable[[], Any], step: int, *,
                   metadata: dict[str, Any] | None = None) -> SaveHandle | None:
        """Save if the save policy — or a preemption notice — says so (building the state only then); the
        handle, or ``None``. With a ``memory`` tier, the steps it is due at (``every_n_steps``) are also snapshot
        in memory (a step saved to disk is one already); without a ``save_policy`` only an explicit :meth:`save`
        goes to disk. After a notice the first call saves, waits up to ``preemption_grace_s`` for the
        commit and upload and sets :attr:`preempted`. Every rank calls it at the same steps; rank 0's policy
        decides for all (:meth:`decide`). Raises ``ConfigError`` without a ``save_policy``; otherwise as :meth:`save`.
        """
        decided, preempting = self.decide(step)
        state = make_state() if decided else None
        handle = self.save(state, step, metadata=metadata) if decided else None
        self._parts.memory.beside_save(make_state if state is None else lambda: state, step, saved=decided,
                                       metadata=metadata, resumed_at=self.resumed_step)
        if preempting:
            self.finish_preemption()
        return handle

    def decide(self, step: int) -> tuple[bool, bool]:
        """``(save now, preempting)`` at ``step``, the same on every rank (see :class:`SaveScheduler`)."""
        self._check_open()
        return self._scheduler.decide(step)

    def should_save(self, step: int, *, policy: SavePolicy | None = None) -> bool:
        """This process's decision alone (``policy``: an adapter's own instead of ``save_policy``); each call is
        a decision point (the gaps measure how much a running write slows training)."""
        self._check_open()
        return self._scheduler.should_save(step, policy=policy)

    def preemption_pending(self) -> bool:
        """A preemption notice arrived and :meth:`finish_preemption` has not run yet."""
        return self._scheduler.preemption_pending()

    def finish_preemption(self) -> None:
        """Wait up to ``preemption_grace_s`` for pending commits and uploads; set :attr:`preempted`. With the
        engine's own (default) notice, the signal's previous disposition then runs (by default: the process ends)."""
        self._scheduler.finish_preemption()

    @property
    def preempted(self) -> bool:
        """A preemption notice arrived and its checkpoint was handled: the loop should stop."""
        return self._scheduler.preempted

    def decision_context(self, step: int) -> DecisionContext:
        """What a save-decision policy sees at ``step`` now."""
        return self._scheduler.context(step)

    def summary(self) -> dict[str, float | int | None]:
        """How checkpointing went so far (``None`` where nothing is measured yet): ``saves``, intervals, the stall
        (``stall_p50_s``, ``stall_fraction``), ``fence_wait_s``, ``overlapped_saves``, ``save_p50_s``,
        ``write_slowdown``, ``upload_lag_p50_s``; with a remote, how far behind it is (``remote_behind_steps``,
        ``remote_behind_bytes``, ``oldest_unsynced_age_s``, ``upload_failures``). The docs list each key."""
        return self._parts.summary()

    def prune(self) -> None:
        """Apply the retention policies to both tiers now (they also run after every commit and upload): when
        what a policy keeps changed in between. Pending, uploading and the newest checkpoints are kept."""
        self._check_open()
        self._parts.pipeline.prune()

    def _check_open(self) -> None:
        if self._closed:
            raise PersistError(f"this CheckpointEngine on {self._root} is closed; create a new one")

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed locally and, with a remote, uploaded, and every memory
        snapshot taken is committed.

        Raises:
            TimeoutError: something is still pending after ``timeout`` seconds.
            RemoteError: uploads still fail after ``remote_timeout_s`` (names the un-synced steps).
            PersistError: a background failure no other call has raised yet (raised once).
        """
        self._parts.wait(_knobs.check_timeout(timeout))

    def close(self, *, keep_memory: bool = False) -> None:
        """Wait for pending saves, release threads; raises a background failure once. Idempotent. The run is
        over: its memory snapshots are removed, unless ``keep_memory`` (a run that failed: the restart reads
        them; leaving a ``with`` block by an exception keeps them too)."""
        self._close(finished=not keep_memory)

    def _close(self, *, finished: bool) -> None:
        if not self._closed:
            self._closed = True  # closed from here, whatever the drain raises
            self._parts.drain_and_close(finished=finished)

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:
            self._close(finished=False)  # the run failed: its memory snapshots stay for the restart
        except PersistError as background:  # do not mask the body's exception; still report this one
            log.error("[rank=%d] background failure while leaving on %r: %s", self._coll.rank, exc, background)

    @property
    def local_dir(self) -> Path:
        return self._root

    @property
    def reader(self) -> CheckpointReader:
        """The engine's read side (same tiers), e.g. for ``reader.step_of(path)`` or ``reader.latest()``."""
        return self._reader

    def list(self, tier: str = "local") -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest and file sizes check, oldest first.

        Args:
            tier: ``"local"``, ``"remote"``, or ``"all"`` (both, each with its ``tier``).
        """
        return self._reader.list(tier)

    def resume_from(self, step: int, *, from_remote: bool = False, loaded: Manifest | None = None) -> None:
        """Say that this run continues from committed checkpoint ``step`` (``load`` says so by itself). A save
        past it while newer ones are committed starts a branch: those are set aside on both tiers (kept, listed
        by :meth:`abandoned`). ``from_remote``: it was downloaded, so this run takes over the remote's lease.
        ``loaded``: the manifest of the checkpoint the caller loaded it from (:meth:`verify_resume` compares with it).
        Raises ``ConfigError`` for a step committed on neither tier (naming those that are)."""
        self._resumption.resume_from(step, from_remote=from_remote, loaded=loaded)

    def _continue_from(self, step: int, *, from_remote: bool = False) -> None:
        """:meth:`resume_from` without the check that ``step`` is committed here (a session's weights-only engine)."""
        self._resumption.continue_from(step, from_remote=from_remote)

    @property
    def resumed_step(self) -> int | None:
        """The committed step this run continues from (:meth:`load` or :meth:`resume_from`), or ``None``."""
        return self._resumption.step

    def abandoned(self, tier: str = "local") -> list[CheckpointInfo]:
        """Checkpoints set aside by a branch (see :meth:`resume_from`), oldest first."""
        return self._reader.abandoned(tier)

    def load(self, step: int | None = None, *, into: Any = None, map_location: Any = "cpu",
             verify: bool | None = None, weights_only: bool = True) -> Any:
        """Load the newest committed checkpoint that verifies, or the one for ``step``: the local copy when it
        verifies, else the remote's (streamed, verified, and kept locally for the next restore), so a fresh
        machine resumes with ``engine.load()`` alone. ``into``: targets on this run's mesh filled in place
        (resharding). ``weights_only=False``: full pickle, for checkpoints you trust. As
        :meth:`CheckpointReader.load`; raises ``CheckpointNotFoundError`` or ``CorruptCheckpointError``.
        """
        self._check_open()
        return self._resumption.load(step, into=into, map_location=map_location, verify=verify, rank=self._coll.rank,
                                     weights_only=weights_only)

    def verify_resume(self, state: Any, *, ignore: Sequence[str] = (), new_ok: Sequence[str] = (),
                      partial: bool = False) -> list[str]:
        """Compare ``state``, the live state a run resumes with, with the checkpoint this engine loaded last: the key
        paths (as ``persist inspect`` writes them, e.g. ``optim/param_groups/0/lr``) whose values differ, that the
        checkpoint has and ``state`` lacks, or the other way round; ``[]`` when equal (one INFO line says so). The
        baseline is what was saved (each tensor's digest, recorded at save; each scalar in the manifest); key paths
        matching ``verify_resume_ignore`` are skipped; sharded leaves of a resharded load, pickled leaves and
        checkpoints older than format version 7 are not verified (logged, never a mismatch). ``verify_resume="off"``:
        ``[]`` without comparing. Adapters pass what legitimately differs: ``ignore`` (globs added to
        ``verify_resume_ignore``), ``new_ok`` (globs of key paths the state may have that the checkpoint lacks) and
        ``partial`` (compare only the top-level keys ``state`` has: what the framework restores). Raises
        ``ResumeMismatchError`` if ``verify_resume="raise"`` and something differs (``"warn"``, the default, issues a
        ``ResumeMismatchWarning`` instead)."""
        return self._resumption.verify(state, ignore=ignore, new_ok=new_ok, partial=partial)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def rank(self) -> int:
        return self._coll.rank
