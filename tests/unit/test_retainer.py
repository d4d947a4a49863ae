"""The Retainer: one retention loop over a tier, as tables over a fake tier (no I/O)."""

from __future__ import annotations

import threading

import pytest

from persist_core import CheckpointInfo, ConfigError, KeepEveryNSteps, KeepLastN
from persist_core.policies.anyof import AnyOf
from persist_core.policies.retention import Retainer


class FakeTier:
    """A tier in memory: ``list`` and ``remove`` over the steps it holds, and what was removed, in order."""

    kind = "local"
    location = "fake://tier"

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)
        self.removed: list[int] = []

    def list(self) -> list[CheckpointInfo]:
        return [CheckpointInfo(step=s, time=float(s), nbytes=1, path=f"fake://tier/{s}") for s in sorted(self.steps)]

    def remove(self, step: int) -> None:
        self.steps.discard(step)
        self.removed.append(step)


@pytest.mark.parametrize(
    ("policy", "protected", "referenced", "left"),
    [
        (None, set(), set(), [1, 2, 3, 4, 5]),  # no policy keeps everything
        (KeepLastN(1), set(), set(), [5]),
        (KeepLastN(2), {1}, set(), [1, 4, 5]),  # protected: being written, or not uploaded yet
        (KeepLastN(1), set(), {2}, [2, 5]),  # others depend on 2: never removed while they do
        (KeepLastN(1), {1}, {2, 3}, [1, 2, 3, 5]),
        (KeepLastN(1), set(), {9}, [5]),  # a step the tier does not hold changes nothing
        (AnyOf(KeepLastN(1), KeepEveryNSteps(2)), set(), {3}, [2, 3, 4, 5]),
    ],
)
def test_a_pass_removes_what_the_policy_lets_go_and_nothing_protected_or_referenced(policy, protected, referenced,
                                                                                      left):
    tier = FakeTier(1, 2, 3, 4, 5)
    removed = Retainer(tier, policy, protected=lambda: set(protected), referenced=lambda: set(referenced)).apply()
    assert sorted(tier.steps) == left
    assert [c.step for c in removed] == sorted({1, 2, 3, 4, 5} - set(left))
    assert tier.removed == sorted({1, 2, 3, 4, 5} - set(left), reverse=True)  # the newest first: no dangling reference


def test_the_sets_are_read_at_each_pass():
    tier = FakeTier(1, 2, 3)
    depended: set[int] = {1}
    retainer = Retainer(tier, KeepLastN(1), referenced=lambda: set(depended))
    retainer.apply()
    assert sorted(tier.steps) == [1, 3]
    depended.clear()  # nothing depends on 1 any more: the next pass lets it go
    retainer.apply()
    assert sorted(tier.steps) == [3]


def test_the_newest_stays_whatever_the_policy_says():
    class DropAll:
        def should_keep(self, checkpoints, *, context):
            assert context.tier == "local"
            return [False] * len(checkpoints)

    tier = FakeTier(1, 2)
    Retainer(tier, DropAll()).apply()
    assert sorted(tier.steps) == [2]


def test_a_policy_that_answers_wrongly_removes_nothing():
    class Short:
        def should_keep(self, checkpoints, *, context):
            return [False]

    tier = FakeTier(1, 2, 3)
    with pytest.raises(ConfigError, match="answered 1 times for 3 checkpoints"):
        Retainer(tier, Short()).apply()
    assert tier.removed == []


def test_two_threads_never_prune_one_tier_at_once():
    inside = threading.Event()
    release = threading.Event()
    overlapped: list[bool] = []

    class Slow(FakeTier):
        busy = False

        def list(self):
            overlapped.append(self.busy)
            self.busy = True
            inside.set()
            release.wait(10)
            self.busy = False
            return super().list()

    tier = Slow(1, 2, 3)
    retainer = Retainer(tier, KeepLastN(1))
    first = threading.Thread(target=retainer.apply)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=retainer.apply)
    second.start()
    release.set()
    first.join(10)
    second.join(10)
    assert overlapped == [False, False] and sorted(tier.steps) == [3]
