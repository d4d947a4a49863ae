"""``PersistSession``: what every framework adapter does with an engine.

The Lightning plugin and strategies, the Accelerate hook and the Hugging Face Trainer callback
stand on this one seam instead of each reaching into the engine's modules:

* the user's keywords are one frozen :class:`~persist_core.config.Config` (checked there);
* :class:`PersistSession` opens the engine once (with the adapter's collectives, and what its
  links name kept besides the user's retention), saves each step once (a second save of a step this session
  saved returns the first handle), turns "that step is already committed" into an error naming
  the adapter's resume call, reports each finished save once (log + the adapter's loggers),
  installs the SIGTERM flush or the preemption notice, and on close drains (bounded after a
  preemption), prunes, logs the summary and puts every signal handler back;
* the names users give checkpoints (:mod:`persist_core.links`) link to them once committed
  (:meth:`PersistSession.link`), and every engine's retention keeps what they link to.

Who calls what: the adapter, on the training thread, calls :meth:`PersistSession.open` (or
:meth:`save`, which opens), :meth:`save`, :meth:`link`, :meth:`report`, and :meth:`close`; the
engine's own threads never call the session (the writer thread calls the links it made).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from persist_core.config import Config
from persist_core.distributed import Collectives, SingleProcess
from persist_core.engine import CheckpointEngine
from persist_core.errors import ConfigError, DirectoryInUseError, StepExistsError
from persist_core.handle import SaveHandle, SaveStats
from persist_core.history import describe_summary
from persist_core.layout import FULL, kind_subdir
from persist_core.links import Links
from persist_core.policies.anyof import AnyOf
from persist_core.policies.save import SavePolicy
from persist_core.preemption import PreemptionNotice, SignalFlush, drain_within
from persist_core.load.reader import CheckpointReader
from persist_core.load.verify import verify_resume
from persist_core.format.manifest import Manifest

log = logging.getLogger(__name__)


class PersistSession:
    """One adapter's engine, opened once, with the bookkeeping every adapter needs.

    Args:
        options: what the user configured.
        resume_hint: how this adapter's users resume a run (named when a step is committed already),
            e.g. ``"resume that run with trainer.fit(..., ckpt_path=io.latest_path())"``.
        release_hint: what this process holds when its own earlier adapter still writes ``local_dir`` and the
            call that lets go of it, e.g. ``"... io.teardown() on the first PersistCheckpointIO"``.
        links: the names this adapter's users give checkpoints (on ``options.local_dir``); ``None``: none.
    """

    def __init__(self, options: Config, *, resume_hint: str, release_hint: str | None = None,
                 links: Links | None = None) -> None:
        self.options = options
        self.links = links
        self._hint = resume_hint
        self._release_hint = release_hint
        self._engine: CheckpointEngine | None = None
        self._reader: CheckpointReader | None = None
        self._read_manifest: Manifest | None = None  # what the session's own reader loaded last (verify_resume's)
        self._collectives: Collectives = SingleProcess()
        self._saved: dict[tuple[str, int], SaveHandle | None] = {}  # (kind, step); None: restored from it
        self._offered = -1  # the last step offered to the memory tier (first_offer)
        self._others: dict[str, CheckpointEngine] = {}  # the engines of kinds other than full, by kind
        self._unreported: list[SaveHandle] = []
        self._flush: SignalFlush | None = None
        self.notice: PreemptionNotice | None = None

    # ---- the engine

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    @property
    def leader(self) -> bool:
        return self._collectives.rank == 0

    def use_collectives(self, collectives: Collectives) -> None:
        """Every rank writes from the next save on (an engine already open is closed first)."""
        for engine in self.engines():
            engine.close()
        self._engine, self._others = None, {}
        self._collectives = collectives

    def open(self, *, preemption: bool = False) -> CheckpointEngine:
        """The engine, created on the first call.

        Args:
            preemption: create a :class:`PreemptionNotice` on ``preemption_signals`` (with a
                ``save_policy``: the next decision point saves instead of the process ending).
        """
        if self._engine is not None:
            return self._engine
        o = self.options
        if preemption and self.notice is None:
            self.notice = PreemptionNotice(o.preemption_signals)
        self._engine = self._new_engine(FULL, save_policy=o.save_policy, preemption=self.notice)
        if self._reader is not None and self._reader.loaded_step is not None:  # resumed before the engine opened
            self._engine.resume_from(self._reader.loaded_step, from_remote=self._reader.loaded_from_remote,
                                     loaded=self._read_manifest)  # what its verify_resume compares with
        return self._engine

    def open_kind(self, kind: str) -> CheckpointEngine:
        """The engine of one kind of checkpoint (see :mod:`persist_core.layout`): ``full`` is :meth:`open`'s;
        ``weights-only`` ones go to ``local_dir/weights-only`` (and ``remote_url/weights-only``), with
        the same options and a retention of their own, and continue from the step the run resumed from.
        """
        if kind == FULL:
            return self.open()
        if kind in self._others:
            return self._others[kind]
        main = self.open()
        engine = self._new_engine(kind)
        resumed = main.resumed_step
        if resumed is not None:  # the run goes on from there on every kind
            engine._continue_from(resumed, from_remote=main.reader.loaded_from_remote)
        self._others[kind] = engine
        return engine

    def _new_engine(self, kind: str, *, save_policy: SavePolicy | None = None,
                    preemption: PreemptionNotice | None = None) -> CheckpointEngine:
        """An engine on ``kind``'s tier (``local_dir``/``remote_url`` plus its sub-directory) with the user's
        options, and the user's retention together with what the links name (the remote's only when the user
        gave one; with none, the links alone when they retain only what is linked, else nothing is removed)."""
        o = self.options
        user = o.keep_local
        links = self.links
        keep_extra = None if links is None or (user is None and not links.retain_only_linked) else links.keep(kind)
        local = keep_extra if user is None else user if keep_extra is None else AnyOf(user, keep_extra)
        sub = kind_subdir(kind)
        if sub and os.path.islink(o.local_dir / sub):  # planted: never written through
            raise ConfigError(f"{o.local_dir / sub} is a symbolic link where torch-persist keeps its {kind} "
                              "checkpoints; remove it (it is not one torch-persist made) or use another local_dir")
        url = o.remote_url if o.remote_url is None or not sub else f"{o.remote_url.rstrip('/')}/{sub}"
        try:
            config = o.replace(local_dir=o.local_dir / sub if sub else o.local_dir, remote_url=url, keep_local=local,
                               keep_remote=None if user is None or url is None else local, save_policy=save_policy,
                               preemption=preemption, memory=o.memory if not sub else None)  # snapshots: full only
            return CheckpointEngine(config, collectives=self._collectives)
        except DirectoryInUseError as e:
            if self._release_hint is None or not e.this_process:
                raise
            raise DirectoryInUseError(f"{e}. {self._release_hint}") from e

    def engines(self) -> list[CheckpointEngine]:
        """Every engine open now (the full one first)."""
        return [e for e in (self._engine, *self._others.values()) if e is not None]

    @property
    def engine(self) -> CheckpointEngine | None:
        """The open engine, or ``None`` before :meth:`open`."""
        return self._engine

    @property
    def reader(self) -> CheckpointReader:
        """The engine's reader when it is open, else one of the session's own (it never writes)."""
        if self._engine is not None:
            return self._engine.reader
        if self._reader is None:
            o = self.options
            self._reader = CheckpointReader(o.local_dir, remote_url=o.remote_url, storage_options=o.storage_options,
                                            memory=o.memory, verify=o.verify, on_loaded=self._reader_loaded,
                                            remote_encryption_key=o.remote_encryption_key)
        return self._reader

    def _reader_loaded(self, manifest: Manifest) -> None:
        self._read_manifest = manifest

    def verify_resume(self, state: Any, *, ignore: Sequence[str] = (), new_ok: Sequence[str] = (),
                      partial: bool = False) -> list[str]:
        """:meth:`CheckpointEngine.verify_resume`: the open engine's, or, before one is open (a run that saved
        nothing yet), against what this session's reader loaded, without opening one (nor taking its lock)."""
        if self._engine is not None:
            return self._engine.verify_resume(state, ignore=ignore, new_ok=new_ok, partial=partial)
        o = self.options
        return verify_resume(self._read_manifest, state, mode=o.verify_resume, rank=self.collectives.rank,
                             world_size=self.collectives.world_size, ignore=(*o.verify_resume_ignore, *ignore),
                             new_ok=new_ok, partial=partial)

    # ---- saving

    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None,
             kind: str = FULL) -> SaveHandle | None:
        """Save ``(step, kind)`` once: a step this session saved (or restored from) returns its handle.

        Returns:
            The handle (``None`` for a step this session restored from and did not save).

        Raises:
            ConfigError: ``step`` is committed in ``local_dir`` by an earlier run (names the resume call).
        """
        if (kind, step) in self._saved:
            return self._saved[kind, step]
        engine = self.open_kind(kind)
        try:
            handle = engine.save(state, step, metadata=metadata)
        except StepExistsError as e:
            raise ConfigError(
                f"step {step} is already committed in {self.options.local_dir} by an earlier run; {self._hint}, or "
                "give this run its own local_dir (committed checkpoints are never overwritten)"
            ) from e
        self._saved[kind, step] = handle
        self._unreported.append(handle)
        return handle

    def link(self, name: str, step: int, handle: SaveHandle | None, kind: str = FULL, *,
             automatic: bool = False) -> None:
        """``name`` links to ``(kind, step)`` once ``handle``'s save is committed (now for ``None``: a step
        restored from, committed); see :meth:`Links.intend` for ``automatic``. Needs ``links``."""
        links = self.links
        assert links is not None, "PersistSession(links=...) names no links"
        links.intend(name, step, kind, automatic=automatic)
        if handle is None:
            links.on_committed(name, step, True, kind)
        else:
            handle.add_local_callback(lambda committed: links.on_committed(name, step, committed, kind))

    def saved(self, step: int, kind: str = FULL) -> bool:
        return (kind, step) in self._saved

    def handle(self, step: int, kind: str = FULL) -> SaveHandle | None:
        return self._saved.get((kind, step))

    def first_offer(self, step: int) -> bool:
        """Whether ``step`` is to be snapshot now: offered to the memory tier for the first time (the adapters'
        callbacks, two of them or gradient accumulation's repeated optimizer step, offer a step once, taken or not,
        on every rank alike) and, with one process, not saved to disk already (that copy is a snapshot)."""
        if step == self._offered:
            return False
        self._offered = step
        return not (self.saved(step) and self.collectives.world_size == 1)

    def newest_saved(self) -> int:
        return max((step for _, step in self._saved), default=-1)

    def restored(self, step: int) -> None:
        """The state was restored from ``step``: saving it again is a no-op."""
        self._saved.setdefault((FULL, step), None)

    def report(self, sink: Sink | None = None) -> list[SaveStats]:
        """Log each save that finished since the last call, once, and hand ``sink`` its metrics
        (:meth:`SaveStats.metrics`, and the engine's gauges: upload queue depth, failed upload attempts,
        slowdown of the steps a write overlaps) with its step."""
        done = [h for h in self._unreported if h.done()]
        self._unreported = [h for h in self._unreported if not h.done()]
        stats = [h.stats for h in done]
        gauges = self._gauges() if stats and sink is not None else {}
        for s in stats:
            log.info("[step=%d] stall %.3f s, write %.2f GB/s, upload %s GB/s, lag %s s", s.step, s.stall_s,
                     s.write_gbps or 0.0, _fmt(s.upload_gbps), _fmt(s.lag_s))
            if sink is not None:
                sink({**s.metrics(), **gauges}, s.step)
        return stats

    def _gauges(self) -> dict[str, float]:
        engine = self._engine
        if engine is None:
            return {}
        return _numbers(engine.summary(), {"remote_behind_steps": "persist/upload_queue",
                                           "upload_failures": "persist/upload_failures",
                                           "write_slowdown": "persist/write_slowdown"})

    # ---- signals

    def install_flush(self) -> None:
        """On SIGTERM, drain pending saves within the grace period on a thread, then chain (main thread only)."""
        if self._flush is None and self.notice is None:
            flush = SignalFlush(lambda: self.wait, self.options.preemption_grace_s)
            if flush.install():
                self._flush = flush

    def restore_signals(self) -> None:
        """Put back every handler this session installed."""
        if self._flush is not None:
            self._flush.restore()
            self._flush = None
        if self.notice is not None:
            self.notice.restore()
            self.notice = None

    def wait(self, timeout: float | None = None) -> None:
        """Every open engine's :meth:`~CheckpointEngine.wait` (each raises its failure once)."""
        for engine in self.engines():
            engine.wait(timeout)

    # ---- the end

    def close(self, *, preempted: bool = False, sink: Sink | None = None,
              announce: Callable[[str], None] | None = None, failed: bool = False) -> None:
        """Drain, prune, report each save, then the one summary line, and close; puts signal handlers
        back. Raises a failure once.

        After a preemption the wait is bounded by ``preemption_grace_s``; what is not uploaded by
        then stays committed locally (the engine's exit hook goes on uploading while it can, the
        next run uploads the rest).

        Args:
            preempted: bound the wait by ``preemption_grace_s``.
            sink: the adapter's loggers, for each save's stats.
            announce: where the summary goes (an adapter's console channel, e.g. Lightning's
                rank-zero info); default: this module's log at INFO.
            failed: the run ends by an exception: its memory snapshots stay for the restart.
        """
        engine, others = self._engine, list(self._others.values())
        self._engine, self._others = None, {}
        reader, self._reader = self._reader, None
        self.restore_signals()
        if reader is not None:
            reader.close()
        if engine is None:
            return
        summary = None
        try:
            for other in others:  # weights-only checkpoints: drained and closed first, the summary is the run's
                try:
                    if not preempted or drain_within(other.wait, self.options.preemption_grace_s):
                        other.wait()
                        other.prune()
                finally:
                    other.close()
            if preempted and not drain_within(engine.wait, self.options.preemption_grace_s):
                return
            try:
                engine.wait()
                engine.prune()
            finally:
                summary = engine.summary()
                engine.close(keep_memory=failed)
        finally:
            self.report(sink)
            if summary is not None:
                (announce or _log_info)(f"torch-persist: {describe_summary(summary)}")
                if sink is not None and self.newest_saved() >= 0:  # the run's summary, as final values
                    sink(_numbers(summary, {k: f"persist/summary/{k}" for k in (
                        "saves", "interval_p50_s", "interval_p90_s", "stall_fraction", "fence_wait_s",
                        "overlapped_saves", "save_p50_s", "write_slowdown", "upload_lag_p50_s")}), self.newest_saved())
            barrier = getattr(self._collectives, "barrier", None)
            if barrier is not None and self._collectives.world_size > 1:
                barrier()  # every rank done with our groups before any tears them down


#: ``sink(metrics, step)``: where an adapter sends the numbers (a Trainer's loggers, an Accelerator's trackers)
Sink = Callable[[dict[str, float], int], None]


def _numbers(summary: dict[str, Any], names: dict[str, str]) -> dict[str, float]:
    """``summary``'s values under their metric names, those that are measured (not ``None``)."""
    return {name: float(summary[key]) for key, name in names.items() if summary.get(key) is not None}


def _log_info(text: str) -> None:
    log.info("%s", text)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
