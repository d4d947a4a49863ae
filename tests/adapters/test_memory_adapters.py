"""The memory tier through the adapters (issue 42): one option each, a crash, a restart that resumes from memory."""

from __future__ import annotations

import pytest

from accelerate_persist import PersistHook
from persist_core import ConfigError
from tests.support.accelerate_app import build, fresh_accelerator, train, weights
from tests.support.states import assert_state_equal


def test_accelerate_resume_after_a_crash_takes_the_memory_snapshot_and_continues_exactly(tmp_path):
    acc = fresh_accelerator()
    parts = build(acc)
    train(acc, *parts, start=0, stop=17)  # dropout: every RNG state matters
    reference = weights(parts[0])

    options = dict(local_dir=tmp_path / "ckpt", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    acc = fresh_accelerator()
    parts = build(acc)
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        with PersistHook(**options).register(acc) as hook:
            def crash(step):
                if step == 13:
                    raise RuntimeError("NCCL timeout")
            train(acc, *parts, start=0, stop=17, save_every=5, hook=hook, on_step=crash)  # disk at 5 and 10
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(**options).register(acc) as hook:
        start = hook.resume()
        assert start == 12  # the snapshot of step 12 (13 crashed before its maybe_save), not the disk's 10
        train(acc, *parts, start=start, stop=17, hook=hook)
    assert_state_equal(weights(parts[0]), reference)
    assert not list((tmp_path / "shm").rglob("slot-*"))  # the finished run's snapshots are gone


def test_accelerate_memory_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="memory_every_n_steps"):
        PersistHook(local_dir=tmp_path, memory_every_n_steps=0)
    with pytest.raises(ConfigError, match="memory_dir"):
        PersistHook(local_dir=tmp_path, memory_dir=tmp_path / "shm")
