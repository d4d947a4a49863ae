"""``PersistModelParallelStrategy``: the real Trainer with ``ModelParallelStrategy`` (FSDP2 over gloo), its
checkpoints sharded through the plugin, resumed on another number of devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from persist_core import CheckpointReader, ConfigError
from tests.support.lightning_app import linked
from tests.support.ranks import launched
from tests.support.states import assert_state_equal

APP = Path(__file__).resolve().parents[1] / "support" / "model_parallel_app.py"


def run_app(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _same_as_saved(dump: Path, saved: dict) -> None:
    restored = torch.load(dump, weights_only=False)
    assert restored["step"] == saved["global_step"]
    assert_state_equal(dict(restored["model"]), {k: v for k, v in saved["state_dict"].items()})
    assert_state_equal(restored["optim"]["state"], saved["optimizer_states"][0]["state"])


def test_sharded_saves_through_the_plugin_resume_on_three_devices_then_on_one(tmp_path):
    d = tmp_path / "ckpt"
    first = run_app("--local-dir", str(d), "--max-steps", "6", "--devices", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert linked(d / "last.ckpt") == "step-000000000006" and linked(d / "epoch=1-step=4.ckpt") == "step-000000000004"
    with CheckpointReader(d) as reader:
        assert [c.step for c in reader.list()] == [4, 6]  # keep_last=2, top-k removal through the plugin
        saved6 = reader.load(6)  # one process: whole tensors
    manifest = reader.list()[-1]
    assert manifest.nbytes > 0
    # 2 -> 3 devices: every rank reads the parts it holds now, the restored state is the saved one
    # (its three ranks started at once, as torchrun starts them: tests.support.ranks.launched; the first run's two
    # through Lightning's own launcher)
    second = launched([sys.executable, str(APP), "--local-dir", str(d), "--max-steps", "8", "--devices", "3",
                       "--resume", "--dump-at-start", str(tmp_path / "three.pt")], 3, env={"OMP_NUM_THREADS": "1"},
                      timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states from the checkpoint at " + str(d / "step-000000000006") in second.stderr
    _same_as_saved(tmp_path / "three.pt", saved6)
    with CheckpointReader(d) as reader:
        saved8 = reader.load(8)
    # 3 -> 1 device
    third = run_app("--local-dir", str(d), "--max-steps", "10", "--devices", "1", "--resume",
                    "--dump-at-start", str(tmp_path / "one.pt"))
    assert third.returncode == 0, third.stderr[-3000:]
    _same_as_saved(tmp_path / "one.pt", saved8)
    assert "final step 10" in third.stdout


def test_save_distributed_checkpoint_false_is_refused_with_the_fix():
    from lightning_persist import PersistModelParallelStrategy

    with pytest.raises(ConfigError, match="sharded by design"):
        PersistModelParallelStrategy(save_distributed_checkpoint=False)


def test_fit_returns_with_its_last_save_committed_and_linked(tmp_path, held_until_teardown):
    """``ModelParallelStrategy.teardown`` never calls ``checkpoint_io.teardown()``: ``fit`` returned with the
    last save still a ``.tmp-step-*`` and ``last.ckpt`` naming the one before (until the interpreter exited).
    Step 4's write waits until the plugin's ``teardown`` begins, so only a strategy that calls it passes."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_persist import PersistCheckpointIO, PersistModelParallelStrategy
    from tests.support.model_parallel_app import ShardedNet

    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    ops = held_until_teardown(io, step=4)
    Trainer(max_steps=4, accelerator="cpu", devices=1, plugins=[io],
            strategy=PersistModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_last=True)]).fit(ShardedNet())
    # right after fit returned, in this process: no io.wait(), no teardown of the test's own
    assert not [p.name for p in d.iterdir() if p.name.startswith(".tmp-step-")]
    assert (d / "step-000000000004" / "manifest.json").is_file()
    assert linked(d / "last.ckpt") == "step-000000000004"
    assert linked(d / "epoch=0-step=4.ckpt") == "step-000000000004"
    assert ops.entered.is_set()  # step 4's write did wait for the gate
