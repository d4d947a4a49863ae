"""A save that failed may be tried again at once, for the same step: the moment its handle ends, the step is not
pending any more (and the failed write's cleanup never drops the retry from the pending set)."""

from __future__ import annotations

import threading

import pytest

from persist_core import CheckpointEngine, PersistError
from persist_core.handle import ErrorLedger
from persist_core.save import writer as writer_mod
from tests.support.states import assert_state_equal, state_for


def test_a_failed_save_can_be_retried_for_the_same_step_as_soon_as_its_wait_raises(tmp_path, monkeypatch):
    original_commit, original_fail = writer_mod.Writer._commit, ErrorLedger.fail
    ended, proceed = threading.Event(), threading.Event()
    calls = []

    def commit(self, job):
        calls.append(job.handle.step)
        if len(calls) == 1:
            self._pool.release(job.buf)
            raise OSError(28, "No space left on device")
        return original_commit(self, job)

    def fail(self, handle, error, **kw):
        original_fail(self, handle, error, **kw)
        ended.set()
        proceed.wait(10)  # the writer thread holds here: the failed step has not left the pending set yet

    monkeypatch.setattr(writer_mod.Writer, "_commit", commit)
    monkeypatch.setattr(ErrorLedger, "fail", fail)
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        first = engine.save(state_for(1), 1)
        assert ended.wait(10)
        with pytest.raises(PersistError, match="No space left"):
            first.wait()
        retry = engine.save(state_for(1), 1)  # not StepExistsError
        proceed.set()
        retry.wait()
        assert [c.step for c in engine.list()] == [1]
        assert_state_equal(engine.load(1), state_for(1))
