"""Issue 53, items 1 and 2: ``memory_every_n_steps=N`` alone keeps a snapshot every N optimizer steps in every
adapter (no ``io.autosave``, no ``hook.maybe_save()``), and a restart with ``ModelCheckpoint`` continues the live
branch: nothing of its own is set aside, retention keeps the newest ``keep_last``, every link resolves."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer

from accelerate_persist import PersistHook
from lightning_persist import PersistCheckpointIO
from persist_core import CheckpointReader
from tests.support.lightning_app import CrashAt, Net, checkpoint_callback, linked
from tests.support.lightning_app import weights as lightning_weights
from tests.support.states import assert_state_equal


def _trainer(io, d, max_steps, callbacks=()):
    ckpt = checkpoint_callback(d, every_n_train_steps=4, save_top_k=2)
    return Trainer(max_steps=max_steps, plugins=[io], callbacks=[ckpt, *callbacks], accelerator="cpu", devices=1,
                   logger=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_lightning_memory_every_n_steps_alone_snapshots_and_a_restart_continues_the_live_branch(tmp_path):
    straight = Net()
    _trainer(PersistCheckpointIO(local_dir=tmp_path / "a"), tmp_path / "a", 22).fit(straight)

    d, shm = tmp_path / "b", tmp_path / "shm"
    options = dict(local_dir=d, memory_every_n_steps=1, memory_dir=shm, keep_last=3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _trainer(PersistCheckpointIO(**options), d, 22, [CrashAt(7)]).fit(Net())  # the README's one keyword
    io = PersistCheckpointIO(**options)  # a restarted process
    path = io.latest_path()
    assert path is not None and str(shm) in path  # memory's step 7, newer than the disk's 4
    resumed = Net()
    _trainer(io, d, 22).fit(resumed, ckpt_path=path)
    assert_state_equal(lightning_weights(resumed), lightning_weights(straight))  # bit-exact from step 7

    with CheckpointReader(d) as reader:
        assert [c.step for c in reader.list()] == [12, 16, 20]  # keep_last=3 of the live branch
        assert reader.abandoned() == []  # nothing of its own set aside
    for name in os.listdir(d):
        if name.endswith(".ckpt"):
            assert os.path.exists(d / name), name  # every link resolves
    assert linked(d / "last.ckpt") == "step-000000000020"


def _accelerator():
    from tests.support.accelerate_app import fresh_accelerator

    acc = fresh_accelerator(gradient_accumulation_steps=2)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)  # as on a GPU with fp16: it skips steps
    return acc


def _accumulating(acc, *, micro_batches: int, crash_at: int | None = None, hook=None):
    """``micro_batches`` of a model with dropout, accumulating 2 a step, a scheduler, a scaler that skips the step of
    micro-batch 7 (inf loss); resumes after ``hook.resume()`` at the micro-batch the restored counter says."""
    from tests.support.accelerate_app import build

    model, optimizer, loader, scheduler, counter = build(acc)
    batches = [b for _ in range(3) for b in loader]  # fetched first: the prepared loader's epochs draw from the RNG
    start = None
    if hook is not None:
        hook.register(acc)
        start = hook.resume()
    seen = counter.seen // 8  # micro-batches done
    batches = batches[seen:micro_batches]
    for i, (x, y) in enumerate(batches, start=seen):
        if i == crash_at:
            raise RuntimeError("NCCL watchdog timeout")
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if i == 7 else 1.0)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.seen += len(x)
    return model, start


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_accelerate_memory_every_n_steps_alone_snapshots_and_resumes_bit_exactly(tmp_path):
    from tests.support.accelerate_app import weights

    straight = weights(_accumulating(_accelerator(), micro_batches=24)[0])
    options = dict(local_dir=tmp_path / "ckpt", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    with pytest.raises(RuntimeError, match="NCCL"):
        with PersistHook(**options) as hook:  # the README's one keyword; no hook.maybe_save() in the loop
            _accumulating(_accelerator(), micro_batches=24, crash_at=15, hook=hook)
    assert hook.step == 6  # 7 sync points in micro-batches 0..14, the one of micro-batch 7 skipped by the scaler
    with PersistHook(**options) as hook:
        resumed, start = _accumulating(_accelerator(), micro_batches=24, hook=hook)
        assert start == 6 and not list((tmp_path / "ckpt").glob("step-*"))  # from memory alone: nothing lost
        assert hook.step == 11
    assert_state_equal(weights(resumed), straight)


def test_without_the_entry_point_the_plugin_says_once_how_to_snapshot(tmp_path, monkeypatch, caplog):
    import logging

    from lightning_persist import snapshots

    monkeypatch.setattr(snapshots, "entry_points", lambda group: [])  # a source tree on sys.path, not installed
    with caplog.at_level(logging.WARNING, logger="lightning_persist.snapshots"):
        PersistCheckpointIO(tmp_path / "ckpt", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
        PersistCheckpointIO(tmp_path / "other")  # no memory tier: nothing to say
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "pip install" in said[0] and "io.autosave(None)" in said[0], said
    monkeypatch.undo()  # installed (make venv installs the package): nothing to say
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_persist.snapshots"):
        PersistCheckpointIO(tmp_path / "third", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    assert caplog.records == []


@pytest.mark.parametrize("adapter", ["lightning", "accelerate", "hf_trainer"])
def test_a_one_liner_killed_right_after_an_update_loses_that_step_only(tmp_path, adapter):
    """SIGKILL after step 5's update, before its snapshot: the newest committed snapshot is step 4 (the update waited
    for its record), never 3, however slowly the snapshots commit."""
    import signal
    import subprocess
    import sys

    from persist_core import MemoryTier

    local_dir, memory_dir = tmp_path / "ckpt", tmp_path / "shm"
    child = subprocess.run([sys.executable, "-m", "tests.support.oneliner_kill_child", adapter, str(local_dir),
                            str(memory_dir), "5"], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    with CheckpointReader(local_dir, memory=MemoryTier(memory_dir=memory_dir)) as reader:
        latest = reader.latest()
    assert latest is not None and latest.tier == "memory" and latest.step == 4, latest
