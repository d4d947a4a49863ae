"""When to save: small pure save-decision policies, and the preemption notice.

A policy answers ``should_save(context) -> bool`` at each decision point
(:meth:`CheckpointEngine.maybe_save`); it does no I/O and keeps no clock of its own — the
:class:`DecisionContext` carries the time, the last save and what recent saves cost, so tables
of cases test it with a fake clock. Combine with :class:`~persist_core.retention.AnyOf`
(``AnyOf(EveryNSteps(1000), Continuous(min_interval_s=60))``).

* :class:`EveryNSteps` — every ``n`` steps.
* :class:`EveryNSeconds` — once ``seconds`` passed since the last save started.
* :class:`Continuous` — as soon as the previous save has committed locally and
  ``min_interval_s`` passed (Orbax's continuous checkpointing): never a second save in flight.
* :class:`OptimalInterval` — Young/Daly: every ``sqrt(2 · C · MTBF)`` seconds, ``C`` the measured
  cost of recent saves to training (stall, plus the slowdown of the steps their writes overlap,
  :class:`~persist_core.history.SlowdownMeter`), updated as it changes; never faster than the
  previous save commits.

Preemption (see :class:`PreemptionNotice`) overrides every policy: the next decision point saves.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
    """

    step: int
    now: float
    last_step: int | None = None
    last_time: float | None = None
    in_flight: bool = False
    cost_s: float | None = None
    commit_s: float | None = None
    slowdown: float | None = None

    @property
    def since_last_s(self) -> float:
        return math.inf if self.last_time is None else self.now - self.last_time


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

    Until a save has been measured it saves at the first decision point. It never starts a
    save while the previous one is in flight.
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
        return not context.in_flight and context.since_last_s >= self.interval_s(context)


def check_save_policy(policy: object) -> SavePolicy:
    if not callable(getattr(policy, "should_save", None)) or getattr(policy, "kind", "save") != "save":
        raise ConfigError(
            f"save_policy={policy!r} is not a save-decision policy: pass EveryNSteps, EveryNSeconds, Continuous, "
            "OptimalInterval, AnyOf(...) or an object with should_save(context) -> bool"
        )
    return policy  # type: ignore[return-value]


class PreemptionNotice:
    """A flag set by a signal (SIGTERM by default); the handler does nothing else but chain.

    The previous handler runs too when it is a Python function (Lightning's, for instance); the
    default action (ending the process) is replaced: the job saves at its next decision point
    and leaves on its own. Install from the main thread.

    Args:
        signals: the signals that mean "preempted" (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("a PreemptionNotice must be created on the main thread (signals are delivered there)")
        for sig in signals:
            try:
                previous = signal.getsignal(sig)
                signal.signal(sig, self._handle)
            except (TypeError, ValueError, OSError) as e:
                self.restore()
                raise ConfigError(f"signals={signals!r}: {sig!r} cannot be caught ({e}); pass catchable signals such "
                                  "as signal.SIGTERM or signal.SIGUSR1") from None
            self._previous[sig] = previous

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self._event.set()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def is_set(self) -> bool:
        return self._event.is_set()

    def trigger(self) -> None:
        """Set the flag without a signal (a cloud's preemption notice polled by the job, tests)."""
        self._event.set()

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


Clock = Callable[[], float]


def describe_summary(summary: dict[str, Any]) -> str:
    """:meth:`CheckpointEngine.summary` in one line: intervals, stall share, upload lag."""

    def sec(v: Any) -> str:
        return "-" if v is None else f"{v:.1f} s"
    stall, slow = summary["stall_fraction"], summary.get("write_slowdown")
    return (f"{summary['saves']} saves, interval P50 {sec(summary['interval_p50_s'])} / P90 "
            f"{sec(summary['interval_p90_s'])} ({summary['interval_p50_steps'] or '-'} steps), training stalled "
            f"{'-' if stall is None else f'{stall:.1%}'} of the time"
            f"{'' if slow is None else f' and ran {slow:.0%} slower while a save was written'}, upload lag P50 "
            f"{sec(summary['upload_lag_p50_s'])}")

