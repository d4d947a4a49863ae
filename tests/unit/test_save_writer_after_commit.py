"""The writer's after-commit step (Writer._run -> Pipeline._after_commit): the sync side gets each committed
checkpoint before local retention runs, retention keeps what the sync side protects, the handle's local phase
ends only after that step, and a failure there is recorded once without losing the committed checkpoint.

The engine is real and local-only; its sync side is wrapped by a fake that keeps every step it is handed
"un-synced" until a test says it was uploaded (what the real one does with an unreachable remote)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from persist_core import CheckpointEngine, PersistError
from persist_core.policies.retention import KeepLastN
from persist_core.tiers.local import checkpoint_dir, read_manifest
from tests.support import states

WAIT_S = 10.0


class FakeSync:
    """The pipeline's sync side with its uploads faked: every step handed over stays protected until
    :meth:`uploaded`; ``gate`` (if given) holds ``committed`` until set; ``fail`` is raised from it."""

    def __init__(self, engine: CheckpointEngine, events: list[tuple], *, gate: threading.Event | None = None,
                 fail: BaseException | None = None) -> None:
        self._real = engine._parts.pipeline.sync
        self._engine, self.events, self.gate, self.fail = engine, events, gate, fail
        self.unsynced: set[int] = set()
        self.entered = threading.Event()
        self.seen: dict[int, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def committed(self, handle: Any, manifest: Any) -> None:
        step = handle.step
        self.seen[step] = {"local_done": handle._local.done(), "pending": step in self._engine._parts.pipeline.writer.pending_steps(),
                           "on_disk": read_manifest(checkpoint_dir(self._engine._root, step)) == manifest}
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.unsynced.add(step)  # queued, even when what follows fails (as the real upload queue does)
        self.events.append(("handed", step))
        if self.fail is not None:
            raise self.fail
        self._real.committed(handle, manifest)  # no remote: ends the handle's remote phase

    def protected(self) -> set[int]:
        return self._real.protected() | self.unsynced

    def uploaded(self, *steps: int) -> None:
        self.unsynced -= set(steps)


def engine_with_fake_sync(tmp_path, **fake: Any) -> tuple[CheckpointEngine, FakeSync, list[tuple]]:
    engine = CheckpointEngine(tmp_path, keep_local=KeepLastN(1))
    events: list[tuple] = []
    sync = FakeSync(engine, events, **fake)
    engine._parts.pipeline.sync = sync
    local = engine._parts.pipeline.local
    apply = local.apply

    def recording_apply() -> Any:
        removed = apply()
        events.append(("retained", frozenset(sync.unsynced), tuple(i.step for i in removed)))
        return removed

    local.apply = recording_apply
    return engine, sync, events


def committed_steps(engine: CheckpointEngine) -> list[int]:
    return [c.step for c in engine.list()]


def test_each_checkpoint_goes_to_the_sync_side_before_local_retention_which_keeps_every_unsynced_step(tmp_path):
    engine, sync, events = engine_with_fake_sync(tmp_path)
    try:
        for step in (1, 2, 3):
            engine.save(states.state_for(step, (4,)), step=step).wait_local(timeout=WAIT_S)
            # by the time the local phase ends, the sync side had it, then retention ran (knowing it)
            assert events[-2:] == [("handed", step), ("retained", frozenset(range(1, step + 1)), ())]
            assert sync.seen[step] == {"local_done": False, "pending": True, "on_disk": True}
        assert committed_steps(engine) == [1, 2, 3]  # keep_local=KeepLastN(1), but none is uploaded yet
        sync.uploaded(1)
        engine.save(states.state_for(4, (4,)), step=4).wait_local(timeout=WAIT_S)
        assert events[-1] == ("retained", frozenset({2, 3, 4}), (1,))  # only what was uploaded goes
        assert committed_steps(engine) == [2, 3, 4]
        sync.uploaded(2, 3, 4)
        engine.prune()
        assert committed_steps(engine) == [4]
    finally:
        engine.close()


def test_the_local_phase_ends_only_after_the_after_commit_step_returns(tmp_path):
    gate = threading.Event()
    engine, sync, events = engine_with_fake_sync(tmp_path, gate=gate)
    try:
        handle = engine.save(states.state_for(1, (4,)), step=1)
        assert sync.entered.wait(WAIT_S)  # committed, and the sync side is being handed it
        assert committed_steps(engine) == [1]
        with pytest.raises(TimeoutError):
            handle.wait_local(timeout=0)
        assert engine._parts.pipeline.writer.pending_steps() == {1}  # still protected from retention by the writer
        gate.set()
        handle.wait_local(timeout=WAIT_S)
        assert events == [("handed", 1), ("retained", frozenset({1}), ())]
        assert engine._parts.pipeline.writer.pending_steps() == set()
    finally:
        gate.set()
        engine.close()


class RaisingPolicy:
    def should_keep(self, checkpoints, *, context):
        raise RuntimeError("a bug in the user's keep_local")


@pytest.mark.parametrize("where", ["sync side", "local retention"])
def test_a_failing_after_commit_step_is_raised_once_and_the_checkpoint_stays_committed(tmp_path, where):
    fail = RuntimeError("the sync side broke") if where == "sync side" else None
    engine, sync, events = engine_with_fake_sync(tmp_path, fail=fail)
    if where == "local retention":
        engine._parts.pipeline.local.policy = RaisingPolicy()
    try:
        handle = engine.save(states.state_for(1, (4,)), step=1)
        with pytest.raises(PersistError, match="step=1 was committed, but what follows the commit failed") as info:
            handle.wait_local(timeout=WAIT_S)
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError) and str(cause) in ("the sync side broke", "a bug in the user's keep_local")
        assert events == [("handed", 1)]  # no retention pass ended (the sync side had it before retention began)
        assert committed_steps(engine) == [1]  # nothing lost: the manifest and files check
        assert engine._parts.pipeline.writer.pending_steps() == set()
        engine.wait(timeout=WAIT_S)  # the handle's wait raised it: the engine never raises it again
        sync.fail = None
        engine._parts.pipeline.local.policy = KeepLastN(1)
        engine.save(states.state_for(2, (4,)), step=2).wait_local(timeout=WAIT_S)  # the writer goes on
        assert committed_steps(engine) == [1, 2]  # KeepLastN(1), but step 1 is not uploaded yet
        assert events[-1] == ("retained", frozenset({1, 2}), ())
    finally:
        engine.close()


def test_a_failing_after_commit_step_nobody_waited_for_is_raised_by_the_engine_once(tmp_path):
    engine, sync, _ = engine_with_fake_sync(tmp_path, fail=RuntimeError("the sync side broke"))
    try:
        engine.save(states.state_for(1, (4,)), step=1)
        with pytest.raises(PersistError, match="step=1 was committed, but what follows the commit failed"):
            engine.wait(timeout=WAIT_S)
        engine.wait(timeout=WAIT_S)  # once
        assert committed_steps(engine) == [1]
    finally:
        engine.close()
