"""When to save: small pure save-decision policies.

A policy answers ``should_save(context) -> bool`` at each decision point
(:meth:`CheckpointEngine.maybe_save`); it does no I/O and keeps no clock of its own — the
:class:`DecisionContext` carries the time, the last save and what recent saves cost, so tables
of cases test it with a fake clock. Combine with :class:`~persist_core.policies.AnyOf`
(``AnyOf(EveryNSteps(1000), Continuous(min_interval_s=60))``).

* :class:`EveryNSteps` — every ``n`` steps.
* :class:`EveryNSeconds` — once ``seconds`` passed since the last save started.
* :class:`Continuous` — as soon as the previous save has committed locally and
  ``min_interval_s`` passed (Orbax's continuous checkpointing): never a second save in flight.
* :class:`OptimalInterval` — Young/Daly: every ``sqrt(2 · C · MTBF)`` seconds, ``C`` the measured
  cost of recent saves to training (stall, plus the slowdown of the steps their writes overlap,
  :class:`~persist_core.history.SlowdownMeter`), updated as it changes; never faster than the
  previous save commits.

Preemption (:class:`~persist_core.preemption.PreemptionNotice`) overrides every policy: the next
decision point saves (:mod:`persist_core.scheduler`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from persist_core.errors import ConfigError


@dataclass(frozen=True)
class DecisionContext:
    """What a save-decision policy may look at.

    Attributes:
        step: the step of this decision point.
        now: a monotonic clock, seconds.
        last_step: the step of the last save started, or ``None``.
        last_time: when (``now``'s clock) the last save started, or ``None``.
        in_flight: a save is staged or being written (not yet committed locally).
        cost_s: what one recent save cost training, seconds: its stall, plus the slowdown of the
            steps its background write overlapped once that is measured; or ``None``.
        commit_s: how long recent saves took from the call to committed, or ``None``.
        slowdown: how much longer training takes between decision points while a save is being
            written than while none is (0.2: 20% longer), or ``None`` until measured.
        idle_needed: decision points with no save in flight that measuring ``slowdown`` still needs
            (0 once it has them).
        resumed_time: when (``now``'s clock) this process loaded the checkpoint it continues from, or
            ``None``.

    A restarted job's first decisions see what saves cost the process before it (``local_dir``'s
    history), until its own saves are measured.
    """

    step: int
    now: float
    last_step: int | None = None
    last_time: float | None = None
    in_flight: bool = False
    cost_s: float | None = None
    commit_s: float | None = None
    slowdown: float | None = None
    idle_needed: int = 0
    resumed_time: float | None = None

    @property
    def since_last_s(self) -> float:
        return math.inf if self.last_time is None else self.now - self.last_time

    @property
    def since_checkpoint_s(self) -> float:
        """Since the last save started; before this process's first save, since it loaded the checkpoint it
        resumed from (that checkpoint is as recent as a save then); ``inf`` when neither happened."""
        if self.last_time is None and self.resumed_time is not None:
            return self.now - self.resumed_time
        return self.since_last_s


@runtime_checkable
class SavePolicy(Protocol):
    """Decides, at each decision point, whether to save now."""

    def should_save(self, context: DecisionContext) -> bool: ...


def _positive(owner: str, name: str, value: object, *, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ConfigError(f"{owner}({name}={value!r}): {name} must be a {'non-negative' if zero else 'positive'} number")


@dataclass(frozen=True)
class EveryNSteps:
    """Save at every step that is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ConfigError(f"EveryNSteps(n={self.n!r}): n must be an int >= 1")

    def should_save(self, context: DecisionContext) -> bool:
        return context.step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds:
    """Save once ``seconds`` have passed since the last save started (and at the first point)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("EveryNSeconds", "seconds", self.seconds)

    def should_save(self, context: DecisionContext) -> bool:
        return context.since_last_s >= self.seconds


@dataclass(frozen=True)
class Continuous:
    """Save as soon as the previous save has committed and ``min_interval_s`` has passed."""

    min_interval_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("Continuous", "min_interval_s", self.min_interval_s, zero=True)

    def should_save(self, context: DecisionContext) -> bool:
        return not context.in_flight and context.since_last_s >= self.min_interval_s


@dataclass(frozen=True)
class OptimalInterval:
    """Young/Daly: save every ``sqrt(2 · C · mtbf_s)`` seconds, ``C`` a save's measured cost to training.

    The interval counts from the last save, or, in a process that resumed, from the load of the checkpoint it
    resumed from. Until a save has been measured (in this process, or by the one before it on the same
    ``local_dir``: its history file) it saves at the first decision point. Until the slowdown of the
    steps a save overlaps is measured it leaves enough decision points without a save in flight for
    the measurement (``context.idle_needed``): saving back to back would never show what a save
    costs training beyond its stall. It never starts a save while the previous one is in flight.
    """

    mtbf_s: float

    def __post_init__(self) -> None:
        _positive("OptimalInterval", "mtbf_s", self.mtbf_s)

    def interval_s(self, context: DecisionContext) -> float:
        """The interval the policy aims at for this context (0 before any measurement)."""
        if context.cost_s is None:
            return 0.0
        return max(math.sqrt(2.0 * context.cost_s * self.mtbf_s), context.commit_s or 0.0)

    def should_save(self, context: DecisionContext) -> bool:
        if context.slowdown is None and context.idle_needed > 0 and context.last_time is not None:
            return False  # measuring what a save costs: training without one in flight first
        return not context.in_flight and context.since_checkpoint_s >= self.interval_s(context)


def check_save_policy(policy: object) -> SavePolicy:
    if isinstance(policy, type):  # the class itself has should_save too, and fails at the first decision
        raise ConfigError(f"save_policy={policy.__name__} is a class; pass an instance, e.g. "
                          f"save_policy={policy.__name__}(...) (EveryNSteps(100), Continuous())")
    if not callable(getattr(policy, "should_save", None)) or getattr(policy, "kind", "save") != "save":
        raise ConfigError(
            f"save_policy={policy!r} is not a save-decision policy: pass EveryNSteps, EveryNSeconds, Continuous, "
            "OptimalInterval, AnyOf(...) or an object with should_save(context) -> bool"
        )
    return policy  # type: ignore[return-value]


Clock = Callable[[], float]
