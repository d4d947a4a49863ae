"""Retention: the policies (which committed checkpoints of a tier to keep; pure, no I/O) and the
:class:`Retainer` that applies one to a tier.

A policy is any object with ``should_keep(checkpoints, *, context) -> Sequence[bool]``, one
answer per checkpoint, given oldest first. Compose them with :class:`AnyOf`::

    keep = AnyOf(KeepLastN(3), KeepEveryNSteps(1000))

A :class:`Retainer` makes a :class:`RetentionPlan` (:func:`plan_retention`: one decision per checkpoint, with a
typed :class:`RetentionReason`) after each commit on a tier, and removes what it lets go; ``persist gc`` says and
applies the same plan. Whatever the policy says, the newest committed checkpoint, the ``protected`` steps (being
written or uploaded), the steps other checkpoints depend on and those a kept checkpoint references are never deleted.

Who calls what: the engine's writer thread calls :meth:`Retainer.apply` for the local tier after
each commit, the sync thread after each upload (for both tiers); ``engine.prune()`` calls it on
the training thread. One lock per tier, so two threads never prune one tier at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from persist_core.errors import ConfigError
from persist_core.policies.plan import RetentionDecision, RetentionPlan, RetentionReason, decide
from persist_core.tiers.tier import CheckpointInfo, Tier

__all__ = [
    "KeepEveryNSeconds",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeepSteps",
    "RetentionContext",
    "RetentionDecision",
    "RetentionPlan",
    "RetentionPolicy",
    "RetentionReason",
    "Retainer",
    "plan_retention",
    "to_delete",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionContext:
    """What a policy may know besides the checkpoints: the tier and the wall time now."""

    tier: str
    now: float


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides, for committed checkpoints given oldest first, which to keep."""

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]: ...


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{owner}({name}={value!r}): {name} must be an int >= 1")


@dataclass(frozen=True, repr=False)
class KeepLastN:
    """Keep the ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepLastN", "n", self.n)

    def __repr__(self) -> str:
        return f"KeepLastN({self.n})"

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        first_kept = len(checkpoints) - self.n
        return [i >= first_kept for i in range(len(checkpoints))]


@dataclass(frozen=True, repr=False)
class KeepEveryNSteps:
    """Keep milestones: every checkpoint whose step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepEveryNSteps", "n", self.n)

    def __repr__(self) -> str:
        return f"KeepEveryNSteps({self.n})"

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        return [c.step % self.n == 0 for c in checkpoints]


@dataclass(frozen=True, repr=False)
class KeepEveryNSeconds:
    """Keep the oldest checkpoint, then each one saved at least ``seconds`` after the last kept."""

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not self.seconds > 0:
            raise ConfigError(f"KeepEveryNSeconds(seconds={self.seconds!r}): seconds must be a number > 0")

    def __repr__(self) -> str:
        return f"KeepEveryNSeconds({self.seconds:g})"

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        keep, last = [], None
        for c in checkpoints:
            kept = last is None or c.time - last >= self.seconds
            keep.append(kept)
            last = c.time if kept else last
        return keep


@dataclass(frozen=True)
class KeepSteps:
    """Keep the checkpoints of these exact steps."""

    steps: frozenset[int] = field(default_factory=frozenset)

    def __init__(self, steps: Iterable[int]) -> None:
        try:
            values = frozenset(steps)
        except TypeError:
            raise ConfigError(f"KeepSteps(steps={steps!r}): steps must be an iterable of ints") from None
        bad = [s for s in values if not isinstance(s, int) or isinstance(s, bool) or s < 0]
        if bad:
            raise ConfigError(f"KeepSteps: steps {sorted(map(repr, bad))} are not non-negative ints")
        object.__setattr__(self, "steps", values)

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        return [c.step in self.steps for c in checkpoints]


@dataclass(frozen=True, repr=False)
class KeepStepsOf:
    """Keep the steps ``steps()`` names at each decision: what an adapter's own paths point to (Lightning's
    links, the directories ``save_state(dir)`` named). ``label`` is its name in logs."""

    steps: Callable[[], Iterable[int]]
    label: str = "KeepStepsOf"

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        live = set(self.steps())
        return [c.step in live for c in checkpoints]

    def __repr__(self) -> str:
        return f"{self.label}()"


def check_policy(policy: object, *, name: str) -> RetentionPolicy:
    """``policy`` if it has a callable ``should_keep``, else :class:`ConfigError` naming ``name``."""
    if isinstance(policy, type):  # the class itself has should_keep too, and fails after every commit
        raise ConfigError(f"{name}={policy.__name__} is a class; pass an instance, e.g. {name}={policy.__name__}(...) "
                          "(KeepLastN(3), KeepEveryNSteps(1000))")
    if not callable(getattr(policy, "should_keep", None)) or getattr(policy, "kind", "retention") != "retention":
        raise ConfigError(
            f"{name}={policy!r} is not a retention policy: pass e.g. KeepLastN(3), AnyOf(...), "
            "or an object with should_keep(checkpoints, *, context)"
        )
    return policy  # type: ignore[return-value]


def answers(policy: RetentionPolicy, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> list[bool]:
    answer = [bool(a) for a in policy.should_keep(checkpoints, context=context)]
    if len(answer) != len(checkpoints):
        raise ConfigError(
            f"retention policy {policy!r} answered {len(answer)} times for {len(checkpoints)} checkpoints; "
            "should_keep must return one bool per checkpoint"
        )
    return answer


def plan_retention(checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy | None, *,
                   context: RetentionContext, held: Mapping[int, RetentionReason] | None = None,
                   references: Callable[[int], set[int]] | None = None) -> RetentionPlan:
    """The plan for ``checkpoints`` (any order) under ``policy`` (``None`` keeps everything): one decision per
    checkpoint, oldest first, with its reason (:mod:`persist_core.policies.plan` gives their order).

    Args:
        checkpoints: the tier's committed checkpoints.
        policy: the tier's policy.
        context: tier and time.
        held: steps kept whatever the policy says, each with its guard (:data:`~persist_core.policies.plan.GUARDS`).
        references: ``references(step)``: the checkpoints ``step`` references (its manifest's ``depends_on()``).

    Raises:
        ConfigError: a custom policy returned the wrong number of answers.
    """
    ordered = sorted(checkpoints, key=lambda c: c.step)
    keep = [True] * len(ordered) if policy is None or not ordered else answers(policy, ordered, context)
    return decide(ordered, keep, held=held, references=references)


def to_delete(
    checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy, *, context: RetentionContext, protected: Iterable[int] = ()
) -> list[CheckpointInfo]:
    """The checkpoints ``policy`` lets go (oldest first), never the newest one nor a ``protected`` step: the
    :attr:`~RetentionReason.PRUNE` decisions of :func:`plan_retention`, references not followed.

    Args:
        checkpoints: the tier's committed checkpoints (any order).
        policy: the tier's policy.
        context: tier and time.
        protected: steps that must stay whatever the policy says (being written or uploaded).

    Raises:
        ConfigError: a custom policy returned the wrong number of answers.
    """
    held = dict.fromkeys(protected, RetentionReason.UNSYNCED)
    return [d.info for d in plan_retention(checkpoints, policy, context=context, held=held).decisions if d.removed]


class Retainer:
    """Plans ``policy`` over ``tier`` and applies the plan, never touching the steps held by a guard.

    Call order: :meth:`apply` (the engine: after each commit, after each upload, ``engine.prune()``), or
    :meth:`plan` then :meth:`carry_out` (``persist gc``: says the plan, then removes what it names).

    Args:
        tier: where the checkpoints are (``list`` and ``remove`` are called).
        policy: what to keep; ``None`` keeps everything.
        protected: steps that must stay whatever the policy says (being written, or not yet uploaded),
            read at each pass (:attr:`~RetentionReason.UNSYNCED`).
        referenced: steps other checkpoints reference (an incremental save being written names bytes in them),
            read at each pass; kept whatever the policy says while they are (:attr:`~RetentionReason.DEPENDED_ON`).
        references: ``references(step)``: the checkpoints committed checkpoint ``step`` references (its
            manifest's ``depends_on()``); a checkpoint that one kept references is kept, counted by no policy.
        held: more steps kept whatever the policy says, each with its guard, read at each pass (``persist gc``: the
            newest checkpoint that verifies).
    """

    def __init__(self, tier: Tier, policy: RetentionPolicy | None, protected: Callable[[], set[int]] = set,
                 referenced: Callable[[], set[int]] = set,
                 references: Callable[[int], set[int]] | None = None,
                 held: Callable[[], Mapping[int, RetentionReason]] = dict) -> None:
        self.tier = tier
        self.policy = policy
        self._protected = protected
        self._referenced = referenced
        self._references = references
        self._held = held
        self._lock = threading.Lock()

    def apply(self) -> list[CheckpointInfo]:
        """One pass: plan, then remove what the plan lets go; returns what it removed (oldest first).

        Raises:
            ConfigError: a custom policy answered the wrong number of times (nothing removed).
        """
        if self.policy is None:
            return []
        with self._lock:
            return self._carry_out(self._plan(None), lambda decision: None)

    def plan(self, listing: Sequence[CheckpointInfo] | None = None) -> RetentionPlan:
        """What a pass would do now, over ``listing`` (default: the tier's listing); removes nothing.

        Raises:
            ConfigError: a custom policy answered the wrong number of times.
        """
        with self._lock:
            return self._plan(listing)

    def carry_out(self, plan: RetentionPlan,
                  each: Callable[[RetentionDecision], object] = lambda decision: None) -> list[CheckpointInfo]:
        """Remove what ``plan`` lets go, the newest first, calling ``each`` after each removal; returns what went
        (oldest first)."""
        with self._lock:
            return self._carry_out(plan, each)

    def _plan(self, listing: Sequence[CheckpointInfo] | None) -> RetentionPlan:
        held = {**dict.fromkeys(self._referenced(), RetentionReason.DEPENDED_ON),
                **dict.fromkeys(self._protected(), RetentionReason.UNSYNCED)}
        for step, reason in self._held().items():
            held.setdefault(step, reason)
        context = RetentionContext(tier=self.tier.kind, now=time.time())
        return plan_retention(self.tier.list() if listing is None else listing, self.policy, context=context,
                              held=held, references=self._references)

    def _carry_out(self, plan: RetentionPlan, each: Callable[[RetentionDecision], object]) -> list[CheckpointInfo]:
        for decision in plan.removals:
            info = decision.info
            log.info("[step=%d] %s retention (%r) removes %s", info.step, self.tier.kind, self.policy, info.path)
            self.tier.remove(info.step)
            each(decision)
        return [d.info for d in plan.decisions if d.removed]
