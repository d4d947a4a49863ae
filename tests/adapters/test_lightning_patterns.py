"""Common Lightning patterns with the real ``Trainer`` and ``Fabric``: gradient accumulation, weights-only
saves beside full ones, ``last.ckpt`` while commits lag, waiting on a hand-made save, the console summary,
and the exit status after SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_persist import PersistCheckpointIO, StrategyBypassWarning, load_from_checkpoint
from persist_core import CheckpointEngine, CheckpointReader, ConfigError, WriteError
from persist_core.cli import main as persist
from tests.support.fakes import FailingOps, GatedOps
from tests.support.lightning_app import Net, checkpoint_callback, linked, weights
from tests.support.states import assert_state_equal

APP = Path(__file__).parents[1] / "support" / "lightning_app.py"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def trainer(io, max_steps: int, callbacks, **kwargs) -> Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return Trainer(max_steps=max_steps, plugins=[io] if io is not None else None, callbacks=callbacks, **options)


def every_step(d: Path, **kwargs) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(d), every_n_train_steps=1, save_top_k=-1, save_last=True, **kwargs)



# ---------------------------------------------------------------- 1: gradient accumulation


def test_resume_with_gradient_accumulation_goes_on_like_lightnings_own_io(tmp_path):
    """Lightning saves the resumed step again (global_step does not move on the first micro-batch):
    the re-save replaces the committed one, as the default IO's overwrite does."""
    finals = {}
    for name, make_io in (("persist", lambda d: PersistCheckpointIO(local_dir=d)), ("torch", lambda d: TorchCheckpointIO())):
        d = tmp_path / name
        trainer(make_io(d), 3, [every_step(d)], accumulate_grad_batches=2).fit(Net())
        model = Net()
        io = make_io(d)
        resume = io.latest_path() if name == "persist" else str(d / "last.ckpt")
        trainer(io, 5, [every_step(d)], accumulate_grad_batches=2).fit(model, ckpt_path=resume)
        finals[name] = weights(model)
    assert_state_equal(finals["persist"], finals["torch"])
    d = tmp_path / "persist"
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) == [
        f"step-{s:012d}" for s in (1, 2, 3, 4, 5)]
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    assert PersistCheckpointIO(local_dir=d).load_checkpoint(d / "last.ckpt")["global_step"] == 5


def test_a_resaved_step_is_replaced_atomically_never_a_moment_without_it(tmp_path):
    d = tmp_path / "ckpt"
    with CheckpointEngine(d) as engine:
        engine.save({"w": torch.ones(1000)}, step=3)
    ops = GatedOps()
    with CheckpointEngine(d, file_ops=ops) as engine:
        engine.load()  # resumed from 3
        engine.save({"w": torch.zeros(1000)}, step=3)
        assert ops.entered.wait(30)
        assert CheckpointReader(d).load(3)["w"].equal(torch.ones(1000))  # the old one, while the new one is written
        ops.gate.set()
    assert CheckpointReader(d).load(3)["w"].equal(torch.zeros(1000))
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith((".lock", ".history"))) == ["step-000000000003"]


def test_a_committed_step_of_an_earlier_run_is_still_refused_without_a_resume(tmp_path):
    d = tmp_path / "ckpt"
    with CheckpointEngine(d) as engine:
        engine.save({"w": torch.ones(10)}, step=3)
    io = PersistCheckpointIO(local_dir=d)
    with pytest.raises(Exception, match="already committed"):
        io.save_checkpoint({"global_step": 3, "w": torch.zeros(10)}, d / "x.ckpt")
    io.teardown()
    assert CheckpointReader(d).load(3)["w"].equal(torch.ones(10))


# ---------------------------------------------------------------- 2: weights-only beside full


def test_weights_only_and_full_saves_of_one_step_are_two_checkpoints(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, keep_last=1)
    callbacks = [  # the weights-only one first: it saves each step before last.ckpt does
        ModelCheckpoint(dirpath=str(d), filename="weights-{step}", every_n_train_steps=2, save_top_k=1,
                        save_weights_only=True),
        ModelCheckpoint(dirpath=str(d), every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
                        save_last=True),
    ]
    trainer(io, 6, callbacks).fit(Net())
    assert "optimizer_states" in io.load_checkpoint(d / "last.ckpt")
    weights_only = io.load_checkpoint(d / "weights-step=6.ckpt")
    assert "optimizer_states" not in weights_only and "state_dict" in weights_only
    # latest_path names the newest full checkpoint; a resume from last.ckpt restores the optimizer
    fresh = PersistCheckpointIO(local_dir=d)
    assert fresh.load_checkpoint(fresh.latest_path())["optimizer_states"]
    trainer(fresh, 8, [], enable_checkpointing=False).fit(Net(), ckpt_path=str(d / "last.ckpt"))
    # persist ls lists both, each with its kind; retention (keep_last=1) counted each kind apart
    listing = CliRunner().invoke(persist, ["ls", str(d), "--json"], catch_exceptions=False)
    rows = [(r["step"], r["kind"]) for r in json.loads(listing.output)]
    assert rows == [(6, "full"), (6, "weights-only")]
    assert "weights-only" in CliRunner().invoke(persist, ["ls", str(d)], catch_exceptions=False).output


# ---------------------------------------------------------------- 3: last.ckpt while commits lag


def test_last_ckpt_names_the_newest_committed_request_when_each_commit_lands_after_the_next_save(tmp_path, engine_ops):
    ops = GatedOps()
    engine_ops(ops)
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, max_pending=2)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, d / "last.ckpt")
    assert ops.entered.wait(30)
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(10)}, d / "last.ckpt")  # requested before 1 commits
    ops.gate.set()
    handle = io._session.handle(1)
    handle.wait_local()
    # step 1 committed while step 2 was already requested: last.ckpt names step 1 until step 2 commits
    assert linked(d / "last.ckpt") in ("step-000000000001", "step-000000000002")
    io.wait()
    assert linked(d / "last.ckpt") == "step-000000000002"
    io.teardown()


# ---------------------------------------------------------------- 4: the paths are files torch.load reads


def test_every_path_is_a_file_that_torch_load_and_load_from_checkpoint_read(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    model = Net(width=24)
    trainer(io, 4, [checkpoint_callback(d)]).fit(model)
    for name, step in (("last.ckpt", 4), ("epoch=0-step=4.ckpt", 4), ("epoch=0-step=3.ckpt", 3)):
        path = d / name
        assert path.is_file() and not path.is_dir()
        for options in ({"weights_only": False}, {"weights_only": False, "mmap": True}):
            plain = torch.load(path, **options)
            assert plain["global_step"] == step
            ours = io.load_checkpoint(path)  # verified: every chunk's crc32c
            assert_state_equal(plain["state_dict"], ours["state_dict"])
            assert plain["optimizer_states"][0]["state"].keys() == ours["optimizer_states"][0]["state"].keys()
    loaded = Net.load_from_checkpoint(d / "last.ckpt")
    assert loaded.hparams.width == 24
    assert_state_equal(weights(loaded), weights(model))
    assert_state_equal(weights(load_from_checkpoint(Net, d / "last.ckpt")), weights(model))
    # the file is the shard: written once, no second copy
    shard = d / "step-000000000004" / "rank-00000.ckpt"
    assert os.path.samefile(d / "last.ckpt", shard)
    assert sorted(p.name for p in shard.parent.iterdir()) == ["manifest.json", "rank-00000.ckpt"]


def test_fabric_saves_of_plain_tensors_load_with_torch_load_weights_only(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(4, 2))
    fabric.save(d / "w.ckpt", {"model": model.state_dict(), "step": 7, "lr": [0.1, 0.01]})
    io.wait()
    plain = torch.load(d / "w.ckpt", weights_only=True, mmap=True)
    assert plain["step"] == 7 and plain["lr"] == [0.1, 0.01]
    assert_state_equal(plain["model"], model.state_dict())
    io.teardown()


def test_a_state_torch_cannot_name_falls_back_to_a_directory_link_that_still_loads(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    base = torch.arange(8, dtype=torch.float32)
    io.save_checkpoint({"global_step": 1, "a": base, "b": base.view(torch.int32)}, d / "x.ckpt")  # one storage, 2 dtypes
    io.wait()
    assert (d / "x.ckpt").is_dir() and linked(d / "x.ckpt") == "step-000000000001"
    loaded = io.load_checkpoint(d / "x.ckpt")
    assert loaded["a"].equal(base) and loaded["b"].equal(base.view(torch.int32))
    io.teardown()


# ---------------------------------------------------------------- 6: wait for a hand-made save


def test_io_wait_makes_a_hand_made_save_exist_and_raises_a_failure_once(tmp_path, engine_ops):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    t = trainer(io, 2, [], enable_checkpointing=False)
    model = Net()
    t.fit(model)
    t.save_checkpoint(tmp_path / "by-hand" / "final.ckpt")
    io.wait()
    assert os.path.lexists(tmp_path / "by-hand" / "final.ckpt")
    assert io.load_checkpoint(tmp_path / "by-hand" / "final.ckpt")["global_step"] == 2
    io.teardown()

    engine_ops(FailingOps(always=True))
    failing = PersistCheckpointIO(local_dir=tmp_path / "full")
    failing.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, tmp_path / "full" / "a.ckpt")
    with pytest.raises(WriteError):
        failing.wait()
    failing.wait()  # raised once
    failing.teardown()


def test_fabric_flush_with_io_wait(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(4, 2))
    fabric.save(d / "fabric.ckpt", {"model": model, "step": 3})
    io.wait()  # Fabric never calls teardown: this is the flush
    assert linked(d / "fabric.ckpt") == "step-000000000003"
    assert CheckpointReader(d).load(3)["step"] == 3
    io.teardown()


# ---------------------------------------------------------------- 7: strategies that go around CheckpointIO


class Sharded(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 8)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)


def model_parallel(io, d: Path, *, distributed: bool) -> Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return trainer(io, 4, [ModelCheckpoint(dirpath=str(d), every_n_train_steps=1, save_top_k=2, monitor="step",
                                           mode="max", save_last=True)],
                   strategy=ModelParallelStrategy(save_distributed_checkpoint=distributed))


def test_model_parallel_strategy_writing_its_own_checkpoints_is_said_once_and_its_removals_happen(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    with pytest.warns(StrategyBypassWarning) as said:
        model_parallel(io, d, distributed=True).fit(Sharded())
    ours = [w for w in said if issubclass(w.category, StrategyBypassWarning)]
    assert len(ours) == 1
    assert "ModelParallelStrategy" in str(ours[0].message) and "PersistDDPStrategy" in str(ours[0].message)
    # its own directories: save_top_k=2 removed the older ones, as the default IO does
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".ckpt")) == [
        "epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]


def test_model_parallel_strategy_that_could_not_resume_from_the_plugin_is_refused_with_the_fix(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=False.*PersistDDPStrategy"):
        model_parallel(io, d, distributed=False).fit(Sharded())
    assert not [p for p in d.iterdir() if p.name.startswith("step-")] if d.exists() else True


# ---------------------------------------------------------------- 8: one summary on the console


def test_one_summary_last_through_lightnings_rank_zero_info_with_short_policy_names(tmp_path, caplog):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, keep_last=2, keep_every_n_steps=4)
    with caplog.at_level(logging.INFO):
        trainer(io, 5, [checkpoint_callback(d)]).fit(Net())  # save_top_k=2: retention removes the rest
    ours = [r for r in caplog.records if r.name.startswith(("persist_core", "lightning_persist"))
            or "torch-persist" in r.getMessage()]
    summaries = [r for r in ours if "torch-persist:" in r.getMessage()]
    assert len(summaries) == 1 and summaries[0] is ours[-1], [r.getMessage() for r in ours]
    assert summaries[0].name.endswith("utilities.rank_zero")  # Lightning's rank-zero info: shown by a default run
    assert "5 saves" in summaries[0].getMessage()
    text = "\n".join(r.getMessage() for r in ours)
    assert "AnyOf(AnyOf(" not in text and "KeepLinkedByLightning" not in text
    assert "KeepLastN(2) | KeepEveryNSteps(4)" in text


# ---------------------------------------------------------------- 9: exit status after SIGTERM


def test_after_a_sigterm_stop_the_process_exits_as_sigterm_would(tmp_path):
    d = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, str(APP), "--local-dir", str(d), "--max-steps", "50", "--term-at", "3"],
                         capture_output=True, text=True, timeout=240)
    assert "Received SIGTERM" in run.stderr, run.stderr[-3000:]
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-3000:]
    assert linked(d / "last.ckpt") == "step-000000000003"  # flushed before the exit
    assert CheckpointReader(d).load(3)["global_step"] == 3


def test_a_replaced_step_is_uploaded_over_the_remote_copy(tmp_path):
    url = (tmp_path / "remote").as_uri()
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.save({"w": torch.ones(100)}, step=3)
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.load()
        engine.save({"w": torch.zeros(100)}, step=3)
    fresh = CheckpointReader(tmp_path / "fresh", remote_url=url)
    assert fresh.load(3)["w"].equal(torch.zeros(100))


# ---------------------------------------------------------------- stray links (issue 18 item 9)


def test_links_to_checkpoints_a_branch_set_aside_are_removed_not_left_dangling(tmp_path):
    d = tmp_path / "ckpt"
    trainer(PersistCheckpointIO(local_dir=d), 6, [every_step(d)]).fit(Net())
    io = PersistCheckpointIO(local_dir=d)  # back to step 3 on purpose: 4..6 are set aside
    trainer(io, 4, [every_step(d)]).fit(Net(), ckpt_path=str(d / "epoch=0-step=3.ckpt"))
    links = {p.name: p for p in d.iterdir() if p.is_symlink()}
    # 5 and 6 are gone; the new 4 took "-v1" (Lightning found the old 4's path), and the old 4's path names the new 4
    assert set(links) == {f"epoch=0-step={s}.ckpt" for s in (1, 2, 3, 4)} | {"epoch=0-step=4-v1.ckpt", "last.ckpt"}
    assert all(p.exists() for p in links.values())  # every path that exists loads
    assert [a.step for a in CheckpointReader(d).abandoned()] == [4, 5, 6]


def test_overlapped_saves_hold_the_same_state_as_plain_ones_step_for_step(tmp_path):
    fences = []

    def run(d, overlap: bool) -> dict[int, dict]:
        io = PersistCheckpointIO(local_dir=d)
        extra = [io.overlap()] if overlap else []
        fences.extend(extra)
        trainer = Trainer(max_steps=5, plugins=[io], accelerator="cpu", devices=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[checkpoint_callback(d, save_top_k=-1), *extra])
        torch.manual_seed(0)
        trainer.fit(Net())
        with CheckpointReader(d) as reader:
            return {c.step: reader.load(c.step) for c in reader.list()}

    plain, overlapped = run(tmp_path / "plain", False), run(tmp_path / "overlap", True)
    assert sorted(plain) == sorted(overlapped) == [1, 2, 3, 4, 5]
    for step in plain:  # every checkpoint is the state at its save, though the next step ran during its copy
        assert_state_equal(overlapped[step]["state_dict"], plain[step]["state_dict"])
        assert_state_equal(overlapped[step]["optimizer_states"], plain[step]["optimizer_states"])
    assert fences[0].overlapped == 5  # each save's parameters were copied in the background
