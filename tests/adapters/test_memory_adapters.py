"""The memory tier through the adapters (issue 42): one option each, a crash, a restart that resumes from memory."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from accelerate_persist import PersistHook
from lightning_persist import PersistCheckpointIO
from persist_core import ConfigError
from tests.support.accelerate_app import build, fresh_accelerator, train, weights
from lightning.pytorch import Trainer

from tests.support.lightning_app import CrashAt, Net, checkpoint_callback, linked, make_trainer
from tests.support.lightning_app import weights as lightning_weights
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


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_lightning_restart_resumes_from_the_memory_snapshot_through_latest_path(tmp_path):
    straight = Net()
    make_trainer(PersistCheckpointIO(local_dir=tmp_path / "a"), tmp_path / "a", 9).fit(straight)

    d = tmp_path / "b"
    options = dict(local_dir=d, memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    io = PersistCheckpointIO(**options)
    autosave = io.autosave(None)  # memory only; ModelCheckpoint writes to disk every 4 steps
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _trainer(io, d, [autosave, CrashAt(6)]).fit(Net())
    assert autosave.snapshot_steps == [1, 2, 3, 4, 5, 6]  # ModelCheckpoint (it runs last) wrote 4 to disk
    assert (d / "last.ckpt").exists() and linked(d / "last.ckpt") == "step-000000000004"  # disk names stay disk

    io = PersistCheckpointIO(**options)  # a restarted process
    path = io.latest_path()
    assert path is not None and str(tmp_path / "shm") in path  # the freshest source: memory, step 6
    resumed = Net()
    _trainer(io, d, [io.autosave(None)]).fit(resumed, ckpt_path=path)
    assert_state_equal(lightning_weights(resumed), lightning_weights(straight))
    assert not list((tmp_path / "shm").rglob("slot-*"))  # the finished run's snapshots are gone


def _trainer(io, d, callbacks):
    return Trainer(max_steps=9, plugins=[io], callbacks=[checkpoint_callback(d, every_n_train_steps=4), *callbacks],
                   accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
def test_hf_trainer_sigkilled_run_restarts_from_the_memory_snapshot_through_resume_path(tmp_path):
    pytest.importorskip("transformers")
    from accelerate_persist import PersistTrainerCallback
    from tests.adapters.test_hf_trainer import run

    straight = run(tmp_path / "straight", [])
    local_dir, memory_dir = tmp_path / "ckpt", tmp_path / "shm"
    child = subprocess.run([sys.executable, "-m", "tests.support.hf_trainer_child", str(tmp_path / "ours"),
                            str(local_dir), str(memory_dir), "6"], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]  # disk at 4, memory at 1..6 (not 4)
    assert sorted(p.name for p in local_dir.glob("step-*")) == ["step-000000000004"]

    fresh = PersistTrainerCallback(local_dir=local_dir, memory_every_n_steps=1, memory_dir=memory_dir)
    resume = fresh.resume_path()
    # memory, newer than the disk's 4: step 6, or 5 when the kill came before step 6's record (<= 1 step lost)
    assert resume is not None and resume.endswith(("checkpoint-6", "checkpoint-5"))
    ours = run(tmp_path / "ours2", [fresh], resume=resume, save_steps=4)
    assert_state_equal(ours.state_dict(), straight.state_dict())
    assert not list(memory_dir.rglob("slot-*"))  # the finished run removed the snapshots
