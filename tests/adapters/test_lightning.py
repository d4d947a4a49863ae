"""``PersistCheckpointIO`` with the real Lightning ``Trainer`` and ``Fabric``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_persist import PersistCheckpointIO, load_from_checkpoint
from persist_core import CheckpointReader, CheckpointNotFoundError, ConfigError, PersistError, WriteError
from tests.support.lightning_app import Net, linked, make_trainer, weights
from tests.support.fakes import FailingOps, GatedOps
from tests.support.ranks import launched
from tests.support.states import assert_state_equal

APP = Path(__file__).parents[1] / "support" / "lightning_app.py"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def ckpt_files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.name.endswith(".ckpt")}


def step_dirs(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.name.startswith("step-")}


def fit(io, dirpath, max_steps, ckpt_path=None, **kwargs) -> Net:
    model = Net()
    make_trainer(io, dirpath, max_steps, **kwargs).fit(model, ckpt_path=ckpt_path)
    return model



def test_top_k_leaves_exactly_the_expected_files_and_each_loads(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    model = fit(io, d, max_steps=9)
    # save_top_k=2 on "step" + save_last: the two newest, and last.ckpt naming the newest
    assert ckpt_files(d) == {"epoch=1-step=8.ckpt", "epoch=1-step=9.ckpt", "last.ckpt"}
    assert step_dirs(d) == {"step-000000000008", "step-000000000009"}
    assert linked(d / "last.ckpt") == "step-000000000009"
    for name in ckpt_files(d):
        loaded = io.load_checkpoint(d / name)
        assert loaded["global_step"] == int(linked(d / name)[-3:])
        assert loaded["state_dict"]["net.0.weight"].device.type == "cpu"
    assert_state_equal(io.load_checkpoint(d / "last.ckpt")["state_dict"], weights(model))


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    straight = fit(PersistCheckpointIO(local_dir=tmp_path / "a"), tmp_path / "a", max_steps=9)

    io = PersistCheckpointIO(local_dir=tmp_path / "b")
    fit(io, tmp_path / "b", max_steps=6)
    resumed = fit(io, tmp_path / "b", max_steps=9, ckpt_path="last")
    assert_state_equal(weights(resumed), weights(straight))

    # and through latest_path(), with a fresh plugin as a restarted process would have
    io2 = PersistCheckpointIO(local_dir=tmp_path / "b")
    assert io2.latest_path() == str(tmp_path / "b" / "step-000000000009")


def test_milestones_survive_save_top_k_and_keep_last_bounds_the_rest(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, keep_every_n_steps=4)
    fit(io, d, max_steps=9)
    assert ckpt_files(d) == {"epoch=1-step=8.ckpt", "epoch=1-step=9.ckpt", "last.ckpt"}
    assert step_dirs(d) == {"step-000000000004", "step-000000000008", "step-000000000009"}
    assert io.load_checkpoint(d / "step-000000000004")["global_step"] == 4


def test_a_remove_while_the_write_is_pending_never_resurrects_the_path(tmp_path, engine_ops):
    """Lightning issue #14035: AsyncCheckpointIO let a queued write recreate a removed file."""
    ops = GatedOps()
    engine_ops(ops)
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, max_pending=2)  # the next save does not wait for the gated one
    state = {"global_step": 1, "w": torch.ones(1000)}
    io.save_checkpoint(state, d / "a.ckpt")
    assert ops.entered.wait(30)
    io.remove_checkpoint(d / "a.ckpt")  # the write is still pending
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path=d / "b.ckpt", storage_options=None)
    ops.gate.set()
    io.teardown()
    assert ckpt_files(d) == {"b.ckpt"}
    assert step_dirs(d) == {"step-000000000002"}


def test_last_ckpt_always_names_a_committed_checkpoint(tmp_path, engine_ops):
    ops = GatedOps()
    engine_ops(ops)
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    ops.gate.set()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, d / "last.ckpt")
    io._session.engine.wait()
    ops.gate.clear()
    ops.entered.clear()
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(10)}, d / "last.ckpt")
    assert ops.entered.wait(30)
    # step 2 is being written: last.ckpt still names step 1, which loads
    assert linked(d / "last.ckpt") == "step-000000000001"
    reader = PersistCheckpointIO(local_dir=d)
    assert reader.load_checkpoint(d / "last.ckpt")["w"].equal(torch.ones(10))
    ops.gate.set()
    io.teardown()
    assert linked(d / "last.ckpt") == "step-000000000002"
    assert step_dirs(d) == {"step-000000000002"}


def test_teardown_raises_a_write_failure_once_and_keeps_earlier_checkpoints(tmp_path, engine_ops):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, d / "one.ckpt")
    io.teardown()
    engine_ops(FailingOps(always=True))
    io.save_checkpoint({"global_step": 2, "w": torch.ones(10)}, d / "two.ckpt")
    with pytest.raises(WriteError, match="No space left"):
        io.teardown()
    io.teardown()  # raised once
    assert ckpt_files(d) == {"one.ckpt"}
    assert io.load_checkpoint(d / "one.ckpt")["global_step"] == 1


def test_bad_input_gets_clear_errors(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, d / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ConfigError, match="remote_url"):
        io.save_checkpoint({"global_step": 1}, "s3://bucket/x.ckpt")
    with pytest.raises(ConfigError, match="keep_last=0"):
        PersistCheckpointIO(local_dir=d, keep_last=0)
    with pytest.raises(CheckpointNotFoundError, match="missing.ckpt"):
        io.load_checkpoint(d / "missing.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, d / "x.ckpt")
    io.teardown()
    # a new run in the same local_dir may not overwrite a committed step
    other = PersistCheckpointIO(local_dir=d)
    with pytest.raises(ConfigError, match="already committed"):
        other.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, d / "y.ckpt")
    assert other.load_checkpoint(d / "x.ckpt")["w"].equal(torch.ones(3))


def test_plain_torch_files_from_another_io_still_load_and_remove(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    TorchCheckpointIO().save_checkpoint({"global_step": 3, "w": torch.ones(2)}, d / "old.ckpt")
    io = PersistCheckpointIO(local_dir=d)
    assert io.load_checkpoint(d / "old.ckpt")["global_step"] == 3
    io.remove_checkpoint(d / "old.ckpt")
    assert not (d / "old.ckpt").exists()


def test_fabric_save_and_load(tmp_path):
    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    fabric.save(d / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    saved = weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(d / "fabric.ckpt", state)  # waits for the pending write
    assert state["step"] == 1
    assert_state_equal(weights(model), saved)
    io.teardown()


def test_fabric_states_keyed_iteration_are_saved_under_that_step(tmp_path):
    io = PersistCheckpointIO(local_dir=tmp_path / "ckpt")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(4, 2))
    for iteration in (10, 20):  # Fabric's own docs key the loop counter "iteration"
        fabric.save(tmp_path / "ckpt" / f"it-{iteration}.ckpt", {"model": model, "iteration": iteration})
    io.wait()
    assert [c.step for c in CheckpointReader(tmp_path / "ckpt").list()] == [10, 20]
    io.teardown()


def test_a_fresh_local_dir_resumes_from_the_s3_remote(tmp_path, bucket, s3_options):
    url = f"s3://{bucket}/run-7"
    straight = fit(PersistCheckpointIO(local_dir=tmp_path / "a"), tmp_path / "a", max_steps=9)

    first = PersistCheckpointIO(local_dir=tmp_path / "b", remote_url=url, storage_options=s3_options, keep_last=2)
    fit(first, tmp_path / "b", max_steps=6)
    # the machine is gone; a new one starts with an empty local_dir
    fresh = PersistCheckpointIO(local_dir=tmp_path / "c", remote_url=url, storage_options=s3_options, keep_last=2)
    latest = fresh.latest_path()
    assert latest == f"{url}/step-000000000006"
    resumed = fit(fresh, tmp_path / "c", max_steps=9, ckpt_path=latest)
    assert_state_equal(weights(resumed), weights(straight))
    remote = [c.step for c in CheckpointReader(tmp_path / "d", remote_url=url, storage_options=s3_options).list("remote")]
    assert remote == [8, 9]


def test_mid_epoch_resume_matches_lightnings_own_io(tmp_path):
    """Stopped mid-epoch, a resume through the plugin is bit-identical to one through TorchCheckpointIO."""
    fit(None, tmp_path / "torch", max_steps=4)
    by_torch = fit(None, tmp_path / "torch", max_steps=9, ckpt_path="last")
    io = PersistCheckpointIO(local_dir=tmp_path / "persist")
    fit(io, tmp_path / "persist", max_steps=4)
    by_plugin = fit(io, tmp_path / "persist", max_steps=9, ckpt_path="last")
    assert_state_equal(weights(by_plugin), weights(by_torch))


def test_save_stats_reach_the_trainers_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    d = tmp_path / "ckpt"
    fit(PersistCheckpointIO(local_dir=d), d, max_steps=5, logger=CSVLogger(tmp_path / "logs", name="run"))
    metrics = (tmp_path / "logs" / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    assert {"persist/stall_s", "persist/write_gbps", "persist/bytes", "persist/durable_s",
            "persist/superseded"} <= set(header)  # (and write_slowdown once steps without a write measured it)
    rows = [dict(zip(header, row.split(","))) for row in metrics[1:]]
    stall = [r["persist/stall_s"] for r in rows]
    assert sum(1 for v in stall if v) == 5  # one per checkpoint, each logged once
    saved = [r for r in rows if r["persist/stall_s"]]
    assert all(float(r["persist/bytes"]) > 0 and float(r["persist/durable_s"]) >= float(r["persist/stall_s"])
               for r in saved)
    # and the run's summary once at the end, as final values
    final = [r for r in rows if r.get("persist/summary/saves")]
    assert len(final) == 1 and float(final[0]["persist/summary/saves"]) == 5
    assert float(final[0]["persist/summary/interval_p50_s"]) > 0 and final[0]["persist/summary/stall_fraction"]


def run_app(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """One run of the app; with ``--devices 2``, Lightning's own launcher starts rank 1 (once rank 0 has imported
    Lightning and built its Trainer)."""
    return subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_ranks(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """A ``--devices 2`` run of the app with both ranks started at once (:func:`tests.support.ranks.launched`):
    the two imports of Lightning side by side instead of one after the other."""
    assert "--devices" in args and args[args.index("--devices") + 1] == "2", args
    return launched([sys.executable, str(APP), *args], 2, timeout=timeout)


def test_ddp_two_ranks_save_and_restore_on_two_and_on_one_and_on_a_fresh_machine_from_the_remote(tmp_path):
    """One DDP run saves (to its local_dir and a file:// remote); then two restores from it, each a DDP run of its
    own: two ranks with an empty node-local directory both from the remote, and two ranks from the local_dir (then
    one process loads what they saved). (One first run for both restores: each DDP launch imports Lightning twice.)"""
    d, remote = tmp_path / "ckpt", (tmp_path / "remote").as_uri()
    first = run_app("--local-dir", str(d), "--max-steps", "6", "--devices", "2", "--strategy", "ddp",
                    "--remote-url", remote)
    assert first.returncode == 0, first.stderr[-3000:]
    assert ckpt_files(d) == {"epoch=1-step=5.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"}

    # a fresh machine: two ranks, one empty node-local directory: both download step 6 at once, one rename wins
    fresh = run_ranks("--local-dir", str(tmp_path / "m2"), "--max-steps", "9", "--devices", "2", "--strategy", "ddp",
                    "--remote-url", remote, "--resume")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {remote}/step-000000000006" in fresh.stderr, \
        "the fresh machine's ranks did not resume from the remote's step 6"
    assert linked(tmp_path / "m2" / "last.ckpt") == "step-000000000009"
    assert not [p for p in (tmp_path / "m2").iterdir() if p.name.startswith(".tmp")]

    # both ranks load it from the local_dir and go on
    second = run_ranks("--local-dir", str(d), "--max-steps", "9", "--devices", "2", "--strategy", "ddp", "--resume",
                     "--out", str(tmp_path / "two.pt"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states from the checkpoint at " + str(d / "step-000000000006") in second.stderr, \
        "the two ranks did not resume from the local_dir's step 6"
    # and one process restores the same checkpoint
    loaded = PersistCheckpointIO(local_dir=d).load_checkpoint(d / "last.ckpt")
    assert loaded["global_step"] == 9
    assert_state_equal(loaded["state_dict"], torch.load(tmp_path / "two.pt"))


def test_sigterm_under_the_trainer_leaves_a_committed_synced_checkpoint(tmp_path, bucket, s3_endpoint, s3_options):
    url = f"s3://{bucket}/run"
    d = tmp_path / "ckpt"
    run = run_app("--local-dir", str(d), "--max-steps", "50", "--term-at", "4", "--remote-url", url,
                  env={"PERSIST_TEST_S3_ENDPOINT": s3_endpoint})
    assert "Received SIGTERM" in run.stderr, run.stderr[-3000:]
    assert linked(d / "last.ckpt") == "step-000000000004"  # training stopped at the next batch
    fresh = PersistCheckpointIO(local_dir=tmp_path / "fresh", remote_url=url, storage_options=s3_options)
    assert fresh.latest_path() == f"{url}/step-000000000004"
    assert fresh.load_checkpoint(fresh.latest_path())["global_step"] == 4


def test_sigterm_under_fabric_flushes_the_upload_then_ends_the_process(tmp_path, bucket, s3_endpoint, s3_options):
    url = f"s3://{bucket}/run"
    child = subprocess.run([sys.executable, str(APP.with_name("fabric_term_child.py")), str(tmp_path / "ckpt"), url],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PERSIST_TEST_S3_ENDPOINT": s3_endpoint})
    assert child.stdout.strip() == "saved", child.stdout + child.stderr[-3000:]
    assert child.returncode == -signal.SIGTERM  # ended as SIGTERM ends a process, after the flush
    fresh = PersistCheckpointIO(local_dir=tmp_path / "fresh", remote_url=url, storage_options=s3_options)
    assert fresh.load_checkpoint(f"{url}/step-000000000007")["step"] == 7


def test_persist_ddp_strategy_every_rank_writes_its_half_and_two_ranks_resume_and_autosave_what_rank_0_decides(
        tmp_path):
    """A persist_ddp run with ModelCheckpoint; its checkpoint restored on one process, then on two, which go on with
    ``io.autosave`` and a policy that disagrees between the ranks. (The restored run is the autosave run: each DDP
    launch imports Lightning twice.)"""
    d = tmp_path / "ckpt"
    common = ("--local-dir", str(d), "--devices", "2", "--strategy", "persist_ddp", "--width", "1024")
    first = run_app(*common, "--max-steps", "6", "--out", str(tmp_path / "six.pt"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert ckpt_files(d) == {"epoch=1-step=5.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"}
    manifest = json.loads((d / "step-000000000006" / "manifest.json").read_text())
    sizes = [f["size"] for f in manifest["files"]]
    assert manifest["world_size"] == 2 and len(sizes) == 2
    assert all(0.3 < s / sum(sizes) < 0.7 for s in sizes), sizes  # each rank wrote about half
    # restored on one process ...
    one = PersistCheckpointIO(local_dir=d).load_checkpoint(d / "last.ckpt")
    assert one["global_step"] == 6
    assert_state_equal(one["state_dict"], torch.load(tmp_path / "six.pt"))
    # split shards: Lightning's loader through ours; the plain call says so (the path is rank 0's part)
    with pytest.raises(PersistError, match="split across 2 ranks.*lightning_persist.load_from_checkpoint"):
        Net.load_from_checkpoint(d / "last.ckpt", weights_only=False)
    with pytest.raises(Exception, match="persist_core.format.torch_zip.split_shard"):
        torch.load(d / "last.ckpt")  # weights_only: torch's own refusal names our loader's module
    model = load_from_checkpoint(Net, d / "last.ckpt")
    assert_state_equal(dict(weights(model.net)), {k.removeprefix("net."): v for k, v in one["state_dict"].items()})
    assert model.hparams.width == 1024

    # ... and on two, which go on training and write again, through io.autosave with a save policy that answers
    # differently on each rank (every 3rd step on rank 0, every 2nd on rank 1: they disagree at 8, 9 and 10, as a
    # time-based policy can); rank 0 decides for all, or a commit that needs both ranks would wait forever
    second = run_ranks(*common, "--max-steps", "12", "--resume", "--autosave-skewed", timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states from the checkpoint at " + str(d / "step-000000000006") in second.stderr
    # the two ranks print to one pipe: a line may end up glued to the other rank's
    reports = [json.loads(m) for m in re.findall(r'\{"rank": \d+, "autosaved": \[[\d, ]*\]\}', second.stdout)]
    saved = {r["rank"]: r["autosaved"] for r in reports}
    assert saved == {0: [9, 12], 1: [9, 12]}, saved  # rank 0's steps after 6, on both ranks
    newest = d / linked(d / "autosave.ckpt")
    assert newest.name == f"step-{saved[0][-1]:012d}"
    assert json.loads((newest / "manifest.json").read_text())["world_size"] == 2  # both ranks wrote it again


def test_persist_ddp_on_two_nodes_with_their_own_disks_and_a_replaced_node_resumes_from_the_remote(tmp_path):
    base, remote = tmp_path / "nvme", (tmp_path / "remote").as_uri()
    common = ("--local-dir", str(base), "--devices", "2", "--strategy", "persist_ddp", "--node-local",
              "--remote-url", remote)
    first = run_ranks(*common, "--max-steps", "6")  # (persist_ddp through Lightning's own launcher: the test above)
    assert first.returncode == 0, first.stderr[-3000:]
    names = ["rank-00000.ckpt", "rank-00001.safetensors"]  # rank 0's part is the torch-loadable one
    for r in (0, 1):  # each node's disk: its own rank's file, and a manifest that says which node it is
        ckpt = base / f"node{r}" / "step-000000000006"
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", names[r]]
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["node"] == r and manifest["nodes"] == [[0], [1]]
    assert sorted(p.name for p in (tmp_path / "remote" / "step-000000000006").iterdir()) == ["manifest.json", *names]
    shutil.rmtree(base / "node1")  # node 1 is replaced: an empty disk
    second = run_ranks(*common, "--max-steps", "9", "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states from the checkpoint at " + str(base / "node0" / "step-000000000006") in second.stderr
    manifest = json.loads((base / "node1" / "step-000000000009" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["node"] == 1


def test_the_standalone_pytorch_lightning_trainer_takes_the_plugin_too(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class PlainNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    model = PlainNet()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[io],
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_last=True)])
    trainer.fit(model)
    assert linked(d / "last.ckpt") == "step-000000000003"
    assert_state_equal(io.load_checkpoint(d / "last.ckpt")["state_dict"], weights(model))


def test_a_local_dir_reached_through_a_symlink(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    d = tmp_path / "alias"
    io = PersistCheckpointIO(local_dir=d)
    model = fit(io, d, max_steps=3)
    assert_state_equal(PersistCheckpointIO(local_dir=d).load_checkpoint(d / "last.ckpt")["state_dict"], weights(model))
    # a resumed run through the alias adopts the links, so retention keeps what they name
    resumed = fit(PersistCheckpointIO(local_dir=d), d, max_steps=5, ckpt_path="last")
    assert ckpt_files(d) == {"epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"}
    assert all((d / name).exists() for name in ckpt_files(d))
    assert_state_equal(PersistCheckpointIO(local_dir=d).load_checkpoint(d / "last.ckpt")["state_dict"], weights(resumed))
    assert PersistCheckpointIO(local_dir=tmp_path / "real").latest_path() == str(tmp_path / "real" / "step-000000000005")


def test_persist_export_makes_a_file_lightnings_default_io_resumes_from(tmp_path):
    from click.testing import CliRunner

    from persist_core.cli import main as persist

    d = tmp_path / "ckpt"
    fit(PersistCheckpointIO(local_dir=d), d, max_steps=6)
    out = tmp_path / "exported.ckpt"
    assert CliRunner().invoke(persist, ["export", str(d), "--to", str(out)]).exit_code == 0
    straight = fit(None, tmp_path / "plain", max_steps=9)
    resumed = fit(None, tmp_path / "plain2", max_steps=9, ckpt_path=str(out))  # TorchCheckpointIO loads it
    assert_state_equal(weights(resumed), weights(straight))


def test_autosave_follows_its_policy_and_retention(tmp_path):
    from lightning.pytorch import Trainer

    from persist_core import EveryNSteps

    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d, keep_last=2)
    autosave = io.autosave(EveryNSteps(3))
    Trainer(max_steps=10, plugins=[io], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=[autosave]).fit(Net())
    assert autosave.saved_steps == [3, 6, 9]
    assert linked(d / "autosave.ckpt") == "step-000000000009"
    assert step_dirs(d) == {"step-000000000006", "step-000000000009"}
    assert io.load_checkpoint(d / "autosave.ckpt")["global_step"] == 9


def test_sigterm_with_autosave_saves_the_step_it_arrived_at_and_syncs_it(tmp_path):
    remote = (tmp_path / "remote").as_uri()
    run = run_app("--local-dir", str(tmp_path / "ckpt"), "--max-steps", "50", "--term-at", "4",
                  "--autosave-every", "1000", "--remote-url", remote)
    assert "Received SIGTERM" in run.stderr, run.stderr[-3000:]
    fresh = PersistCheckpointIO(local_dir=tmp_path / "fresh", remote_url=remote)
    assert fresh.latest_path() == f"{remote}/step-000000000004"  # not a multiple of 1000: the preemption save


def test_fit_from_an_older_checkpoint_branches_and_the_new_branch_is_the_one_kept_and_resumed(tmp_path):
    d = tmp_path / "ckpt"
    fit(PersistCheckpointIO(local_dir=d), d, max_steps=9)
    assert step_dirs(d) == {"step-000000000008", "step-000000000009"}
    io = PersistCheckpointIO(local_dir=d)  # a new process, going back to step 8 on purpose
    fit(io, d, max_steps=12, ckpt_path=str(d / "epoch=1-step=8.ckpt"))
    # as with Lightning's own IO, top-k keeps the resumed-from 8 and the 9 saved again; the old 9 is set aside
    assert ckpt_files(d) == {f"epoch=1-step={s}.ckpt" for s in (8, 9, 11, 12)} | {"last.ckpt"}
    assert step_dirs(d) == {f"step-{s:012d}" for s in (8, 9, 11, 12)}
    assert [a.step for a in CheckpointReader(d).abandoned()] == [9]  # the old 9, set aside, not deleted
    assert PersistCheckpointIO(local_dir=d).latest_path() == str(d / "step-000000000012")


def test_save_last_link_into_a_dirpath_that_does_not_exist_yet(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tmp_path / "not" / "yet"
    io = PersistCheckpointIO(local_dir=tmp_path / "ckpt")
    Trainer(max_steps=3, plugins=[io], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=-1, save_last="link")]).fit(Net())
    assert os.path.islink(d / "last.ckpt")  # Lightning links last.ckpt to the newest path itself
    assert io.load_checkpoint(d / "last.ckpt")["global_step"] == 3


def test_persist_ddp_fit_returns_with_its_last_save_committed_and_linked(tmp_path, held_until_teardown):
    """``PersistDDPStrategy`` keeps ``Strategy.teardown``'s ``checkpoint_io.teardown()`` (``ModelParallelStrategy``
    drops it): step 4's write waits until the plugin's ``teardown`` begins, and ``fit`` returns with it committed."""
    from lightning_persist import PersistDDPStrategy

    d = tmp_path / "ckpt"
    io = PersistCheckpointIO(local_dir=d)
    ops = held_until_teardown(io, step=4)
    fit(io, d, max_steps=4, strategy=PersistDDPStrategy())
    assert not [p.name for p in d.iterdir() if p.name.startswith(".tmp-step-")]
    assert (d / "step-000000000004" / "manifest.json").is_file()
    assert linked(d / "last.ckpt") == "step-000000000004"
    assert ops.entered.is_set()


def test_a_second_plugin_on_a_local_dir_this_process_still_holds_names_the_call_that_releases_it(tmp_path):
    first = PersistCheckpointIO(local_dir=tmp_path / "ckpt")
    trainer = make_trainer(first, tmp_path / "ckpt", max_steps=2)
    trainer.fit(Net())
    trainer.save_checkpoint(tmp_path / "ckpt" / "manual.ckpt")  # outside fit: the plugin opens its engine again
    first.wait()
    second = PersistCheckpointIO(local_dir=tmp_path / "ckpt")
    with pytest.raises(PersistError, match=r"in use.*earlier PersistCheckpointIO.*io\.teardown\(\)"):
        make_trainer(second, tmp_path / "ckpt", max_steps=4).fit(Net(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    first.teardown()
