"""When to save: the save-decision policy at each decision point, agreed across ranks, and preemption.

Who calls what (training thread only): the engine's ``maybe_save``/``decide``/``should_save``
call :class:`SaveScheduler`; a signal handler only sets the :class:`PreemptionNotice` it reads.
With several ranks, :meth:`SaveScheduler.decide` is a collective over the *decision* channel (not
the commit's, which the writer thread uses at the same time): rank 0's policy decides for all,
a notice on any rank makes every rank save that step, and ranks at different steps get a
:class:`~persist_core.errors.ConfigError` on every rank instead of a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from persist_core import _knobs
from persist_core.distributed import Collectives, decision_channel
from persist_core.errors import ConfigError
from persist_core.history import SaveHistory
from persist_core.policies.save import Clock, DecisionContext, SavePolicy
from persist_core.preemption import PreemptionNotice, drain_within

log = logging.getLogger(__name__)


class SaveScheduler:
    """Save decisions for one engine.

    Args:
        policy: the engine's save policy, or ``None`` (then only an adapter's own policy decides).
        preemption: the notice a signal sets, or ``None``.
        grace_s: how long :meth:`finish_preemption` waits for pending commits and uploads.
        coll: the job's collectives.
        history: the saves so far (what policies look at).
        clock: the monotonic clock of decisions.
        in_flight: whether a save is staged or being written now.
        known: whether ``step`` is saved already (pending, or the last save).
        wait: the engine's ``wait(timeout)``.
        memory_only: a memory tier without a ``policy``: :meth:`should_save`'s disk decision is "no" (disk saves are
            the explicit ``save()`` calls).
        exits: ``preemption`` is the engine's own (default) notice: once :meth:`finish_preemption` waited, the
            signal's previous disposition runs (by default: the process ends).
    """

    def __init__(self, *, policy: SavePolicy | None, preemption: PreemptionNotice | None, grace_s: float,
                 coll: Collectives, history: SaveHistory, clock: Clock, in_flight: Callable[[], bool],
                 known: Callable[[int], bool], wait: Callable[[float], None], memory_only: bool = False,
                 exits: bool = False) -> None:
        self._policy = policy
        self._preemption = preemption
        self._grace_s = grace_s
        self._coll = coll
        self._history = history
        self._clock = clock
        self._in_flight = in_flight
        self._known = known
        self._wait = wait
        self._preempt_saved = False
        self._memory_only = memory_only
        self._exits = exits

    def should_save(self, step: int, *, policy: SavePolicy | None = None) -> bool:
        """This process's decision alone; see :meth:`CheckpointEngine.should_save`."""
        step = _knobs.check_step(step)
        writing = self._in_flight()
        known = self._known(step)
        self._history.meter.observe(step, self._clock(), writing)
        if self.preemption_pending():
            return not known
        policy = policy or self._policy
        if policy is None and self._memory_only:
            return False  # a memory tier snapshots; disk saves are the explicit save() calls
        if policy is None:
            raise ConfigError("maybe_save() needs CheckpointEngine(save_policy=...), e.g. Continuous(min_interval_s=30)")
        return not known and bool(policy.should_save(self._history.context(step, writing)))

    def decide(self, step: int) -> tuple[bool, bool]:
        """``(save now, preempting)`` at ``step``, the same on every rank; see :meth:`CheckpointEngine.decide`."""
        preempting = self.preemption_pending()
        decided = self.should_save(step)
        if self._coll.world_size == 1:
            return decided, preempting
        channel = decision_channel(self._coll)
        if channel is None:
            raise ConfigError(
                f"maybe_save across {self._coll.world_size} processes needs collectives with a decision channel "
                f"({self._coll!r} has no 'decisions'); create them with TorchCollectives.new_group()")
        votes = channel.all_gather((step, decided, preempting))
        steps = [v[0] for v in votes]
        if len(set(steps)) > 1:
            raise ConfigError(f"maybe_save was called at different steps on the ranks ({steps}, by rank); "
                              "every rank must call it at the same decision points with the same step")
        if any(v[2] for v in votes):  # a notice on any rank: every rank saves this step unless it is saved
            return not self._known(step), True
        return votes[0][1], False

    def context(self, step: int) -> DecisionContext:
        return self._history.context(step, self._in_flight())

    def preemption_pending(self) -> bool:
        return self._preemption is not None and self._preemption.is_set() and not self._preempt_saved

    def finish_preemption(self) -> None:
        self._preempt_saved = True
        log.warning("[rank=%d] preempted: waiting up to %.0f s for the commit and upload", self._coll.rank,
                    self._grace_s)
        drain_within(self._wait, self._grace_s)
        if self._exits and self._preemption is not None:
            self._preemption.exit_as_signal()

    @property
    def preempted(self) -> bool:
        return self._preempt_saved
