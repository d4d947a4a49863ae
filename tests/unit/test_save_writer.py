"""The writer thread: every way out of a save's local phase ends the handle and reaches the ledger once."""

from __future__ import annotations

import uuid

import pytest

from persist_core import CheckpointEngine, PersistError
from tests.support.fakes import GatedUploads
from tests.support import states


state_for = states.state_for


class OneAnswer:
    """A custom retention policy with a bug: one answer whatever the number of checkpoints."""

    def should_keep(self, checkpoints, *, context):
        return [True]


class Raising:
    def should_keep(self, checkpoints, *, context):
        raise RuntimeError("a bug in the user's policy")


@pytest.mark.parametrize("policy", [OneAnswer(), Raising()], ids=["wrong-count", "raises"])
def test_a_failing_keep_remote_after_the_commit_ends_the_local_phase_and_is_raised_once(tmp_path, monkeypatch, policy):
    uploads = GatedUploads(monkeypatch)
    url = f"memory://writer-tests/{uuid.uuid4().hex}"
    engine = CheckpointEngine(tmp_path, remote_url=url, keep_remote=policy)
    try:
        engine.save(state_for(1), step=1)
        assert uploads.first_started.wait(30)  # step 1 uploads; 2 and 3 queue behind it
        engine.save(state_for(2), step=2).wait_local(timeout=30)
        third = engine.save(state_for(3), step=3)  # queueing it asks the policy which queued upload may go
        with pytest.raises(PersistError, match="step=3 was committed, but what follows the commit failed") as info:
            third.wait_local(timeout=30)  # before: blocked forever (the error went into a future nobody read)
        assert "a bug in the user's policy" in str(info.value) or "answered 1 times" in str(info.value)
        assert [c.step for c in engine.list()] == [1, 2, 3]  # committed, nothing lost
    finally:
        uploads.gate.set()
    raised = []
    for _ in range(6):  # each background failure once, then quiet
        try:
            engine.wait(timeout=60)
            break
        except PersistError as e:
            raised.append(str(e))
    else:
        pytest.fail(f"engine.wait() kept raising: {raised}")
    assert not any("step=3 was committed, but what follows" in r for r in raised)  # third.wait_local took it
    assert len(raised) == len(set(raised))
    engine.close()
