"""Retention policies as tables, and local retention in the engine."""

from __future__ import annotations

import pytest
import torch

from persist_core import (
    AnyOf,
    CheckpointEngine,
    CheckpointInfo,
    ConfigError,
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLastN,
    KeepSteps,
    PersistError,
    RetentionContext,
)
from persist_core.policies.retention import to_delete

CTX = RetentionContext(tier="local", now=10_000.0)


def ckpts(*steps_and_times: tuple[int, float]) -> list[CheckpointInfo]:
    return [CheckpointInfo(step=s, time=t, nbytes=1, path=f"/x/{s}") for s, t in steps_and_times]


STEPS = ckpts(*[(s, 100.0 * i) for i, s in enumerate([100, 200, 300, 400, 500, 1000, 1100, 2000, 2100])])


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (KeepLastN(1), [2100]),
        (KeepLastN(3), [1100, 2000, 2100]),
        (KeepLastN(50), [100, 200, 300, 400, 500, 1000, 1100, 2000, 2100]),
        (KeepEveryNSteps(1000), [1000, 2000, 2100]),
        (KeepEveryNSteps(200), [200, 400, 1000, 2000, 2100]),
        (KeepSteps([300, 1100, 7]), [300, 1100, 2100]),
        (KeepSteps([]), [2100]),
        (KeepEveryNSeconds(250), [100, 400, 1100, 2100]),  # times 0,100,...,800: kept at 0, 300, 600, (newest)
        (KeepEveryNSeconds(100), [100, 200, 300, 400, 500, 1000, 1100, 2000, 2100]),
        (AnyOf(KeepLastN(2), KeepEveryNSteps(1000)), [1000, 2000, 2100]),
        (AnyOf(KeepLastN(1), KeepSteps([200]), KeepEveryNSeconds(500)), [100, 200, 1000, 2100]),
        (AnyOf(KeepEveryNSteps(500)), [500, 1000, 2000, 2100]),
    ],
    ids=repr,
)
def test_policy_table(policy, kept):
    deleted = {c.step for c in to_delete(STEPS, policy, context=CTX)}
    assert [c.step for c in STEPS if c.step not in deleted] == kept


def test_newest_and_protected_are_never_deleted_whatever_the_policy():
    class DeleteEverything:
        def should_keep(self, checkpoints, *, context):
            assert context.tier == "local"
            return [False] * len(checkpoints)

    left = to_delete(STEPS, DeleteEverything(), context=CTX, protected={300, 9999})
    assert {c.step for c in left} == {100, 200, 400, 500, 1000, 1100, 2000}
    assert to_delete([], DeleteEverything(), context=CTX) == []


def test_order_of_input_does_not_matter():
    shuffled = list(reversed(STEPS))
    assert to_delete(shuffled, KeepLastN(2), context=CTX) == to_delete(STEPS, KeepLastN(2), context=CTX)


@pytest.mark.parametrize(
    "make",
    [lambda: KeepLastN(0), lambda: KeepLastN(2.5), lambda: KeepEveryNSteps(-3), lambda: KeepEveryNSeconds(0),
     lambda: KeepEveryNSeconds("1h"), lambda: KeepSteps([1, -2]), lambda: KeepSteps(5), lambda: AnyOf(),
     lambda: AnyOf(KeepLastN(1), "last")],
)
def test_bad_policy_arguments_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()


def test_custom_policy_with_wrong_answer_count_is_named():
    class Broken:
        def should_keep(self, checkpoints, *, context):
            return [True]

    with pytest.raises(ConfigError, match="Broken.*one bool per checkpoint"):
        to_delete(STEPS, Broken(), context=CTX)


def test_engine_keeps_last_n_plus_milestones_on_disk(ckpt_dir):
    with CheckpointEngine(ckpt_dir, keep_local=AnyOf(KeepLastN(2), KeepEveryNSteps(4))) as engine:
        for step in range(1, 11):
            engine.save({"x": torch.full((10,), float(step))}, step=step).wait()
        assert [i.step for i in engine.list()] == [4, 8, 9, 10]
        assert engine.load(4)["x"][0] == 4.0
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith((".lock-", ".history"))) == [f"step-{s:012d}" for s in (4, 8, 9, 10)]


def test_engine_refuses_a_non_policy(ckpt_dir):
    with pytest.raises(ConfigError, match="keep_local=3"):
        CheckpointEngine(ckpt_dir, keep_local=3)


def test_failing_custom_policy_is_raised_once_and_the_checkpoint_stays(ckpt_dir):
    class Boom:
        def should_keep(self, checkpoints, *, context):
            raise RuntimeError("policy bug")

    with CheckpointEngine(ckpt_dir, keep_local=Boom()) as engine:
        handle = engine.save({"x": torch.ones(1)}, step=1)
        with pytest.raises(PersistError, match="step=1 was committed.*policy bug"):
            handle.wait()
        assert [i.step for i in engine.list()] == [1]
