"""The retention plan: one decision per committed checkpoint of a tier, each with a typed reason. Pure: no I/O.

What a :class:`~persist_core.policies.retention.Retainer` removes (the engine after each commit and upload,
``persist gc``) and what ``persist gc`` says (``--dry-run``) and writes (``--json``) are this one plan.

A checkpoint's reason is the first of these that holds:

1. a guard its caller holds it by (:data:`GUARDS`: not yet uploaded, a save being written references it, the newest
   that verifies): kept whatever the policy says;
2. :attr:`RetentionReason.NEWEST`: the newest checkpoint is never removed;
3. :attr:`RetentionReason.KEPT_BY_POLICY`;
4. :attr:`RetentionReason.REFERENCED`: a checkpoint staying references it (an incremental save names bytes in it),
   until none staying references one going;
5. :attr:`RetentionReason.PRUNE`: removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from persist_core.tiers.tier import CheckpointInfo

__all__ = ["GUARDS", "RetentionDecision", "RetentionPlan", "RetentionReason", "decide"]


class RetentionReason(Enum):
    """Why a checkpoint stays, or :attr:`PRUNE`; the value is its name in ``persist gc --json``."""

    UNSYNCED = "unsynced"  #: being written, or not uploaded yet
    DEPENDED_ON = "depended_on"  #: a save being written (or a set-aside checkpoint) references it
    NEWEST_VERIFIED = "newest_verified"  #: the newest checkpoint that verifies (persist gc reads them)
    NEWEST = "newest"  #: the newest checkpoint
    KEPT_BY_POLICY = "kept_by_policy"
    REFERENCED = "referenced"  #: a checkpoint staying references it
    PRUNE = "prune"


#: the reasons a caller may hold a step by (kept whatever the policy says)
GUARDS = frozenset({RetentionReason.UNSYNCED, RetentionReason.DEPENDED_ON, RetentionReason.NEWEST_VERIFIED})


@dataclass(frozen=True)
class RetentionDecision:
    """One checkpoint's fate: its ``reason``, what the policy alone said (``policy_keeps``), and for a
    :attr:`~RetentionReason.REFERENCED` one, the staying checkpoints that reference it."""

    info: CheckpointInfo
    reason: RetentionReason
    policy_keeps: bool
    referenced_by: tuple[int, ...] = ()

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def removed(self) -> bool:
        return self.reason is RetentionReason.PRUNE

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON: ``{step, reason, policy_keeps, referenced_by}``."""
        return {"step": self.step, "reason": self.reason.value, "policy_keeps": self.policy_keeps,
                "referenced_by": list(self.referenced_by)}


@dataclass(frozen=True)
class RetentionPlan:
    """The decisions for a tier's checkpoints, oldest first."""

    decisions: tuple[RetentionDecision, ...] = ()

    @property
    def removals(self) -> tuple[RetentionDecision, ...]:
        """What goes, the newest first: a checkpoint references older ones only, so a kill part-way through the
        removals never leaves one whose references are gone."""
        return tuple(sorted((d for d in self.decisions if d.removed), key=lambda d: -d.step))

    def as_dicts(self) -> list[dict[str, Any]]:
        return [d.as_dict() for d in self.decisions]


def decide(ordered: Sequence[CheckpointInfo], policy_keeps: Sequence[bool], *,
           held: Mapping[int, RetentionReason] | None = None,
           references: Callable[[int], set[int]] | None = None) -> RetentionPlan:
    """The plan for ``ordered`` (oldest first), given the policy's answer for each.

    Args:
        ordered: the tier's checkpoints, oldest first.
        policy_keeps: the policy's answer per checkpoint.
        held: steps kept whatever the policy says, each with its guard (steps not in ``ordered`` change nothing).
        references: ``references(step)``: the checkpoints ``step`` references; read only for checkpoints staying,
            only when one would go, once each.

    Raises:
        ValueError: a ``held`` reason that is no guard (named).
    """
    held = {} if held is None else held
    wrong = {s: r for s, r in held.items() if r not in GUARDS}
    if wrong:
        raise ValueError(f"held={wrong!r}: a step is held by one of {sorted(g.name for g in GUARDS)}")
    if not ordered:
        return RetentionPlan()
    newest = ordered[-1].step
    reasons: dict[int, RetentionReason] = {}
    for c, keep in zip(ordered, policy_keeps):
        reasons[c.step] = held.get(c.step) or (RetentionReason.NEWEST if c.step == newest else
                                                RetentionReason.KEPT_BY_POLICY if keep else RetentionReason.PRUNE)
    by: dict[int, tuple[int, ...]] = {}
    if references is not None:
        by = _spare_referenced(ordered, reasons, references)
    return RetentionPlan(tuple(RetentionDecision(c, reasons[c.step], bool(k), by.get(c.step, ()))
                               for c, k in zip(ordered, policy_keeps)))


def _spare_referenced(ordered: Sequence[CheckpointInfo], reasons: dict[int, RetentionReason],
                      references: Callable[[int], set[int]]) -> dict[int, tuple[int, ...]]:
    """Mark :attr:`~RetentionReason.REFERENCED` (in ``reasons``) every going checkpoint a staying one references, until
    none is left to spare; returns, for each, the staying checkpoints that reference it."""
    gone = {s for s, r in reasons.items() if r is RetentionReason.PRUNE}
    known: dict[int, set[int]] = {}
    spared: set[int] = set()
    while gone:
        staying = [c.step for c in ordered if c.step not in gone]
        for s in staying:
            if s not in known:
                known[s] = set(references(s))
        needed = set().union(*(known[s] for s in staying)) & gone
        if not needed:
            break
        gone -= needed
        spared |= needed
    for s in spared:
        reasons[s] = RetentionReason.REFERENCED
    return {dep: tuple(s for s in sorted(known) if s not in gone and dep in known[s]) for dep in spared}
