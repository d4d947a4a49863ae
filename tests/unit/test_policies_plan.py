"""The retention plan: one decision, with a typed reason, per checkpoint (issue 54 item 3), as a table
(checkpoints x policies x guards -> reasons), and the Retainer applying exactly the plan it makes."""

from __future__ import annotations

import pytest

from persist_core import CheckpointInfo, ConfigError, KeepEveryNSteps, KeepLastN, KeepSteps
from persist_core.policies.anyof import AnyOf
from persist_core.policies.retention import Retainer, RetentionContext, plan_retention
from persist_core.policies.retention import RetentionReason as Reason

CTX = RetentionContext(tier="local", now=1_000.0)
P, POL, NEW, UNS, DEP, REF, VER = (Reason.PRUNE, Reason.KEPT_BY_POLICY, Reason.NEWEST, Reason.UNSYNCED,
                                   Reason.DEPENDED_ON, Reason.REFERENCED, Reason.NEWEST_VERIFIED)


def ckpts(*steps: int) -> list[CheckpointInfo]:
    return [CheckpointInfo(step=s, time=float(s), nbytes=1, path=f"/x/{s}") for s in steps]


class DropAll:
    def should_keep(self, checkpoints, *, context):
        return [False] * len(checkpoints)


# steps 1..5; 4 references 2, 5 references 4 (incremental saves), 3 references 1
REFS = {3: {1}, 4: {2}, 5: {4}}


@pytest.mark.parametrize(
    ("steps", "policy", "held", "refs", "reasons"),
    [
        ([1, 2, 3], None, {}, {}, [POL, POL, NEW]),  # no policy keeps everything
        ([1, 2, 3], KeepLastN(1), {}, {}, [P, P, NEW]),  # the newest: counted by the policy too, said as NEWEST
        ([1, 2, 3], DropAll(), {}, {}, [P, P, NEW]),  # never the newest, whatever the policy says
        ([3, 1, 2], KeepLastN(2), {}, {}, [P, POL, NEW]),  # any order in: the decisions oldest first
        ([2, 4, 6, 7], KeepEveryNSteps(2), {}, {}, [POL, POL, POL, NEW]),
        ([1, 2, 3, 4], AnyOf(KeepLastN(1), KeepSteps([2])), {}, {}, [P, POL, P, NEW]),
        ([1, 2, 3], KeepLastN(1), {1: UNS}, {}, [UNS, P, NEW]),  # not uploaded yet
        ([1, 2, 3], KeepLastN(1), {2: DEP}, {}, [P, DEP, NEW]),  # a save being written references it
        ([1, 2, 3], KeepLastN(3), {2: UNS}, {}, [POL, UNS, NEW]),  # a guard is said even where the policy keeps
        ([1, 2, 3], KeepLastN(1), {3: UNS}, {}, [P, P, UNS]),  # the newest, not uploaded: the guard is said
        ([1, 2, 3], KeepLastN(1), {2: VER}, {}, [P, VER, NEW]),  # gc: the newest that verifies
        ([1, 2, 3], KeepLastN(1), {9: UNS}, {}, [P, P, NEW]),  # a step not listed changes nothing
        ([1, 2, 3, 4, 5], KeepLastN(1), {}, REFS, [P, REF, P, REF, NEW]),  # 5 -> 4 -> 2: a chain is kept
        ([1, 2, 3, 4, 5], KeepLastN(3), {}, REFS, [REF, REF, POL, POL, NEW]),
        ([1, 2, 3, 4, 5], KeepLastN(1), {3: UNS}, REFS, [REF, REF, UNS, REF, NEW]),  # a guarded one's too
        ([1, 2, 3, 4, 5], KeepSteps([3]), {}, {3: {1}}, [REF, P, POL, P, NEW]),
        ([], KeepLastN(1), {}, {}, []),
    ],
)
def test_reasons_table(steps, policy, held, refs, reasons):
    plan = plan_retention(ckpts(*steps), policy, context=CTX, held=held, references=lambda s: set(refs.get(s, ())))
    assert [d.step for d in plan.decisions] == sorted(steps)
    assert [d.reason for d in plan.decisions] == reasons
    assert [d.step for d in plan.removals] == sorted((d.step for d in plan.decisions if d.reason is P), reverse=True)


def test_a_decision_says_what_the_policy_alone_said_and_who_references_it():
    plan = plan_retention(ckpts(1, 2, 3, 4, 5), KeepLastN(2), context=CTX, held={1: UNS},
                          references=lambda s: set(REFS.get(s, ())))
    by_step = {d.step: d for d in plan.decisions}
    assert [by_step[s].policy_keeps for s in (1, 2, 3, 4, 5)] == [False, False, False, True, True]
    assert by_step[2].referenced_by == (4,) and by_step[1].referenced_by == ()
    assert by_step[2].as_dict() == {"step": 2, "reason": "referenced", "policy_keeps": False, "referenced_by": [4]}
    assert by_step[3].as_dict()["reason"] == "prune" and by_step[3].removed and not by_step[4].removed


def test_references_are_read_only_for_staying_checkpoints_and_only_when_one_would_go():
    read: list[int] = []

    def deps(step: int) -> set[int]:
        read.append(step)
        return set(REFS.get(step, ()))

    plan_retention(ckpts(1, 2, 3), KeepLastN(5), context=CTX, references=deps)
    assert read == []  # nothing goes: no manifest read
    plan_retention(ckpts(1, 2, 3, 4, 5), KeepLastN(1), context=CTX, references=deps)
    assert 1 not in read and 3 not in read and read.count(5) == 1  # what goes is never asked; each step once


def test_a_policy_that_answers_wrongly_plans_nothing():
    class Short:
        def should_keep(self, checkpoints, *, context):
            return [False]

    with pytest.raises(ConfigError, match="answered 1 times for 3 checkpoints"):
        plan_retention(ckpts(1, 2, 3), Short(), context=CTX)


class FakeTier:
    kind = "local"

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)
        self.removed: list[int] = []

    def list(self) -> list[CheckpointInfo]:
        return ckpts(*sorted(self.steps))

    def remove(self, step: int) -> None:
        self.steps.discard(step)
        self.removed.append(step)


def test_the_retainer_applies_the_plan_it_makes():
    tier = FakeTier(1, 2, 3, 4, 5)
    retainer = Retainer(tier, KeepLastN(1), protected=lambda: {1}, referenced=lambda: {3},
                        references=lambda s: set(REFS.get(s, ())))
    plan = retainer.plan()
    assert [d.reason for d in plan.decisions] == [UNS, REF, DEP, REF, NEW]
    assert tier.removed == []  # planning removes nothing
    tier.steps.add(0)
    assert [c.step for c in retainer.apply()] == [0] and tier.removed == [0]


def test_the_retainer_plans_over_a_given_listing_with_typed_guards():
    """``persist gc`` counts only the checkpoints that check, and holds the newest that verifies."""
    tier = FakeTier(1, 2, 3, 4)
    retainer = Retainer(tier, KeepLastN(1), held=lambda: {2: VER})
    plan = retainer.plan(ckpts(1, 2, 3))  # 4 does not check: not counted
    assert [(d.step, d.reason) for d in plan.decisions] == [(1, P), (2, VER), (3, NEW)]
    assert [d.reason for d in Retainer(tier, None).plan().decisions] == [POL, POL, POL, NEW]
    assert Retainer(tier, None).apply() == [] and tier.removed == []  # no policy keeps everything
