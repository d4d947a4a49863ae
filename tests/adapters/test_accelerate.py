"""``PersistHook`` with the real ``Accelerator`` (in process, and two gloo processes under torchrun)."""

from __future__ import annotations

import copy
import json
import shutil
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.utils import ProjectConfiguration

from accelerate_persist import PersistHook, export_accelerate
from persist_core import CheckpointReader, ConfigError
from tests.support.accelerate_app import build, fresh_accelerator, train, weights
from tests.support.states import assert_state_equal
from tests.support.moto_server import free_port

APP = Path(__file__).parents[1] / "support" / "accelerate_app.py"


def step_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step-"))


def test_save_mutate_load_restores_everything_bit_exactly(tmp_path):
    acc = fresh_accelerator()
    model, optimizer, loader, scheduler, counter = parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        train(acc, *parts, start=0, stop=5)
        saved = {"model": weights(model), "optim": copy.deepcopy(optimizer.state_dict()), "sched": scheduler.state_dict(),
                 "seen": counter.seen}
        path = acc.save_state()
        assert path == str(tmp_path / "ckpt" / "step-000000000005")
        draws = (random.random(), np.random.rand(), torch.rand(3))  # what the RNGs give right after the save
        train(acc, *parts, start=5, stop=9)  # mutate everything
        acc.load_state()
        assert hook.step == 5
        assert_state_equal(weights(model), saved["model"])
        assert_state_equal(optimizer.state_dict(), saved["optim"])
        assert scheduler.state_dict() == saved["sched"] and counter.seen == saved["seen"]
        assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(3), draws[2])
        # load_state(path) names one checkpoint
        acc.load_state(path)
        assert_state_equal(weights(model), saved["model"])


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    acc = fresh_accelerator()
    parts = build(acc)
    train(acc, *parts, start=0, stop=17)  # 12 batches an epoch; dropout: the RNG states matter
    reference = weights(parts[0])

    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        train(acc, *parts, start=0, stop=14, save_every=6)  # saves at 6 and 12 (an epoch's end)
    # a new process: same code, resume() and go on
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        start = hook.resume()
        assert start == 12
        train(acc, *parts, start=start, stop=17)
    assert_state_equal(weights(parts[0]), reference)


def test_a_second_hook_on_the_same_accelerator_after_close_saves_every_step_it_is_asked_to(tmp_path):
    acc = fresh_accelerator()
    parts = build(acc)
    optimizer = parts[1]
    own_step = optimizer.step
    first = PersistHook(local_dir=tmp_path / "first").register(acc)
    train(acc, *parts, start=0, stop=2, save_every=2)
    first.close()
    assert optimizer.step == own_step and acc.save_state.__func__ is type(acc).save_state  # everything put back
    with PersistHook(local_dir=tmp_path / "second").register(acc) as second:
        train(acc, *parts, start=2, stop=8, save_every=2)
        assert second.step == 6  # it counts the optimizer steps it sees (before: stuck at 0)
    assert step_dirs(tmp_path / "first") == ["step-000000000002"]
    assert step_dirs(tmp_path / "second") == [f"step-{n:012d}" for n in (2, 4, 6)]


def test_total_limit_becomes_keep_last_and_a_conflict_is_an_error(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path / "proj"), total_limit=2, automatic_checkpoint_naming=True)
    acc = fresh_accelerator(project_config=config)
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        train(acc, *parts, start=0, stop=12, save_every=3)
    assert step_dirs(tmp_path / "ckpt") == ["step-000000000009", "step-000000000012"]
    # Accelerate wrote nothing of its own: its automatic names are links to the two checkpoints kept
    links = {p.name: os.path.realpath(p) for p in (tmp_path / "proj" / "checkpoints").iterdir()}
    assert all((tmp_path / "proj" / "checkpoints" / n).is_symlink() for n in links)
    assert links == {"checkpoint_2": str(tmp_path / "ckpt" / "step-000000000009"),
                     "checkpoint_3": str(tmp_path / "ckpt" / "step-000000000012")}

    acc = fresh_accelerator(project_config=config)
    build(acc)
    with pytest.raises(ConfigError, match="total_limit=2"):
        PersistHook(local_dir=tmp_path / "other", keep_last=5).register(acc)


def test_export_loads_with_plain_accelerate(tmp_path):
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        train(acc, *parts, start=0, stop=6, save_every=6)
    saved = weights(parts[0])
    out = export_accelerate(tmp_path / "ckpt", tmp_path / "exported")
    acc = fresh_accelerator()
    model, optimizer, loader, scheduler, counter = build(acc)
    acc.load_state(str(out))  # Accelerate's own load_state: no hook registered
    assert_state_equal(weights(model), saved)
    assert counter.seen == 6 * 8
    # and the command line
    cli = subprocess.run([sys.executable, "-m", "accelerate_persist.export", str(tmp_path / "ckpt"),
                          str(tmp_path / "cli-out"), "--step", "6"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "RuntimeWarning" not in cli.stderr, cli.stderr  # runpy's: the package imported the module first
    assert (tmp_path / "cli-out" / "model.safetensors").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~umask)}  # normal modes


def test_export_from_a_remote_leaves_only_the_checkpoint_files(tmp_path, bucket, s3_options):
    url = f"s3://{bucket}/run"
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt", remote_url=url, storage_options=s3_options).register(acc):
        train(acc, *parts, start=0, stop=3, save_every=3)
    out = export_accelerate(url, tmp_path / "exported", storage_options=s3_options)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no download directory left behind
    assert (out / "model.safetensors").exists()


def test_export_of_an_encrypted_remote_takes_the_key_in_python_and_on_the_command_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from persist_core import PersistError
    from persist_core.cli import main as persist

    url, key = f"memory://{tmp_path.name}/remote", bytes(range(32))
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt", remote_url=url, remote_compression="zstd",
                     remote_encryption_key=key).register(acc):
        train(acc, *parts, start=0, stop=3, save_every=3)
    with pytest.raises(PersistError, match="remote_encryption_key"):
        export_accelerate(url, tmp_path / "no-key")
    assert not (tmp_path / "no-key").exists()
    for out in (export_accelerate(url, tmp_path / "py", remote_encryption_key=lambda: key), tmp_path / "cli"):
        if out.name == "cli":
            monkeypatch.setenv("TRAIN_KEY", key.hex())
            result = CliRunner().invoke(persist, ["--encryption-key-env", "TRAIN_KEY", "export", url, "--to", str(out),
                                                  "--format", "accelerate"])
            assert result.exit_code == 0, result.output
        acc = fresh_accelerator()
        model, *_ = build(acc)
        acc.load_state(str(out))
        assert_state_equal(weights(model), weights(parts[0]))


def test_unregistered_and_unsupported_uses_are_clear_errors(tmp_path):
    acc = fresh_accelerator()
    build(acc)
    hook = PersistHook(local_dir=tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="not registered"):
        hook.wait()
    with pytest.raises(ConfigError, match=r"preemption_signals=\(\) is empty"):
        PersistHook(local_dir=tmp_path / "ckpt", preemption_signals=())
    before = signal.getsignal(signal.SIGTERM)
    hook.register(acc)
    assert signal.getsignal(signal.SIGTERM) is not before  # the flush-on-SIGTERM handler
    with pytest.raises(ConfigError, match="registered already"):
        hook.register(acc)
    hook.close()
    assert acc.save_state.__func__.__qualname__ == "Accelerator.save_state"  # given back
    assert signal.getsignal(signal.SIGTERM) is before  # and the signal handler too


def launch(*args: str, processes: int = 2, env: dict | None = None, timeout: float = 240):
    """``processes`` ranks of the app with gloo, through torchrun: what ``accelerate launch`` runs for several
    processes (its ``--cpu`` mode goes through mpirun, which this machine does not have)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(free_port()), str(APP), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_two_processes_each_write_half_and_restore_on_two_and_on_one(tmp_path):
    d = tmp_path / "ckpt"
    first = launch("--local-dir", str(d), "--steps", "6", "--save-every", "6", "--width", "1024",
                   "--out", str(tmp_path / "two.pt"))
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((d / "step-000000000006" / "manifest.json").read_text())
    sizes = [f["size"] for f in manifest["files"]]
    assert manifest["world_size"] == 2 and all(0.3 < s / sum(sizes) < 0.7 for s in sizes), sizes
    # one process restores it (DDP's "module." names are matched to the plain model)
    acc = fresh_accelerator()
    parts = build(acc, width=1024)
    with PersistHook(local_dir=d).register(acc) as hook:
        assert hook.resume() == 6
    assert_state_equal(weights(parts[0]), torch.load(tmp_path / "two.pt")["weights"])
    # two processes restore it and go on
    second = launch("--local-dir", str(d), "--steps", "9", "--save-every", "3", "--width", "1024", "--resume",
                    "--out", str(tmp_path / "again.pt"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert torch.load(tmp_path / "again.pt")["start"] == 6
    assert step_dirs(d)[-1] == "step-000000000009"


def test_two_processes_on_two_nodes_with_their_own_disks_and_a_replaced_node_resumes_from_the_remote(tmp_path):
    base, remote = tmp_path / "nvme", (tmp_path / "remote").as_uri()
    common = ("--local-dir", str(base), "--width", "1024", "--node-local", "--remote-url", remote)
    first = launch(*common, "--steps", "6", "--save-every", "6", "--out", str(tmp_path / "two.pt"))
    assert first.returncode == 0, first.stderr[-3000:]
    for r in (0, 1):  # each node's disk holds its own rank's file; the remote holds both
        ckpt = base / f"node{r}" / "step-000000000006"
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", f"rank-{r:05d}.safetensors"]
        assert json.loads((ckpt / "manifest.json").read_text())["node"] == r
    assert sorted(p.name for p in (tmp_path / "remote" / "step-000000000006").iterdir()) == [
        "manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    shutil.rmtree(base / "node1")  # node 1 is replaced: an empty disk
    second = launch(*common, "--steps", "9", "--save-every", "3", "--resume", "--out", str(tmp_path / "again.pt"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert torch.load(tmp_path / "again.pt")["start"] == 6
    assert (base / "node1" / "step-000000000009" / "rank-00001.safetensors").exists()


def test_sigkill_mid_save_leaves_the_newest_committed_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, str(APP), "--local-dir", str(d), "--steps", "30", "--save-every", "2",
                          "--kill-after-save", "8", "--out", str(tmp_path / "w")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=d).register(acc) as hook:
        step = hook.resume()
    assert step in (4, 6, 8)  # save(8) returning guarantees step 4 committed; 6 and 8 may have been in flight
    assert_state_equal(weights(parts[0]), torch.load(f"{tmp_path / 'w'}.step{step}"))


def test_a_fresh_local_dir_resumes_from_the_s3_remote(tmp_path, bucket, s3_endpoint, s3_options):
    url = f"s3://{bucket}/run"
    run = subprocess.run([sys.executable, str(APP), "--local-dir", str(tmp_path / "m1"), "--steps", "9",
                          "--save-every", "3", "--remote-url", url, "--out", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PERSIST_TEST_S3_ENDPOINT": s3_endpoint})
    assert run.returncode == 0, run.stderr[-3000:]
    acc = fresh_accelerator()
    parts = build(acc)
    hook = PersistHook(local_dir=tmp_path / "fresh", remote_url=url, storage_options=s3_options)
    with hook.register(acc):
        assert hook.latest() == f"{url}/step-000000000009"
        assert hook.resume() == 9
    assert_state_equal(weights(parts[0]), torch.load(tmp_path / "w")["weights"])


def test_sigterm_flushes_the_pending_upload_then_ends_the_process(tmp_path, bucket, s3_endpoint, s3_options):
    url = f"s3://{bucket}/run"
    run = subprocess.run([sys.executable, str(APP), "--local-dir", str(tmp_path / "m1"), "--steps", "30",
                          "--save-every", "4", "--term-after-save", "4", "--width", "1024", "--remote-url", url],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PERSIST_TEST_S3_ENDPOINT": s3_endpoint})
    assert run.returncode == -signal.SIGTERM, run.stdout + run.stderr[-3000:]
    assert "did not end" not in run.stdout
    acc = fresh_accelerator()
    build(acc, width=1024)
    hook = PersistHook(local_dir=tmp_path / "fresh", remote_url=url, storage_options=s3_options)
    with hook.register(acc):
        assert hook.resume() == 4  # committed and uploaded before the process ended


def test_save_stats_reach_the_accelerators_trackers(tmp_path):
    from accelerate.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[dict, int]] = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values) -> None:
            pass

        def log(self, values, step=None, **kwargs) -> None:
            self.logged.append((dict(values), step))

    recorder = Recorder()
    acc = fresh_accelerator(log_with=[recorder])
    acc.init_trackers("run")
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        train(acc, *parts, start=0, stop=9, save_every=3)
    steps = [step for values, step in recorder.logged if "persist/stall_s" in values]
    assert steps == [3, 6, 9]  # each save reported once (the last at close)
    saves = [values for values, _ in recorder.logged if "persist/stall_s" in values]
    assert all(v["persist/write_gbps"] > 0 and v["persist/bytes"] > 0 and v["persist/durable_s"] >= v["persist/stall_s"]
               and v["persist/superseded"] == 0.0 for v in saves)
    final = [(values, step) for values, step in recorder.logged if "persist/summary/saves" in values]
    assert len(final) == 1 and final[0][1] == 9 and final[0][0]["persist/summary/saves"] == 3
    assert final[0][0]["persist/summary/interval_p50_s"] > 0


def test_persist_export_format_accelerate(tmp_path):
    from click.testing import CliRunner

    from persist_core.cli import main as persist

    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        train(acc, *parts, start=0, stop=4, save_every=4)
    result = CliRunner().invoke(persist, ["export", str(tmp_path / "ckpt"), "--to", str(tmp_path / "acc"),
                                          "--format", "accelerate"])
    assert result.exit_code == 0, result.output
    acc = fresh_accelerator()
    model, *_ = build(acc)
    acc.load_state(str(tmp_path / "acc"))
    assert_state_equal(weights(model), weights(parts[0]))


def test_two_processes_agree_on_every_continuous_decision(tmp_path):
    d = tmp_path / "ckpt"
    run = launch("--local-dir", str(d), "--steps", "24", "--policy", "continuous", "--width", "512",
                 "--decisions", str(tmp_path / "decisions"))
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"decisions.{r}").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and len(ranks[0]) >= 2  # the same saves on both, at the same steps
    committed = [int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step-")]
    assert sorted(committed) == ranks[0]


@pytest.mark.parametrize("term_signal", ["SIGTERM", "SIGUSR1"])  # SIGUSR1: given as preemption_signals
def test_a_preemption_signal_with_a_save_policy_saves_that_step_syncs_it_and_stops(tmp_path, term_signal):
    remote = (tmp_path / "remote").as_uri()
    run = subprocess.run([sys.executable, str(APP), "--local-dir", str(tmp_path / "m1"), "--steps", "100",
                          "--policy", "every4", "--term-at", "10", "--term-signal", term_signal, "--remote-url", remote,
                          "--out", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]  # it left on its own, after the flush
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "fresh", remote_url=remote).register(acc) as hook:
        assert hook.resume() == 10  # the step the notice arrived at (not a multiple of 4)
    assert_state_equal(weights(parts[0]), torch.load(f"{tmp_path / 'w'}.step10"))
    assert torch.load(tmp_path / "w")["weights"] is not None


def test_export_of_another_kind_of_checkpoint_is_refused_before_anything_is_downloaded(tmp_path, bucket, s3_options,
                                                                                       monkeypatch):
    from persist_core import CheckpointEngine
    from persist_core.tiers.remote import RemoteTier

    url = f"s3://{bucket}/lightning-run"
    with CheckpointEngine(tmp_path / "ckpt", remote_url=url, storage_options=s3_options) as engine:
        engine.save({"state_dict": {"w": torch.ones(4)}, "global_step": 3}, step=3)
    fetched = []
    monkeypatch.setattr(RemoteTier, "download", lambda self, *a, **k: fetched.append(a))
    with pytest.raises(ConfigError, match="not saved by accelerate_persist.PersistHook.*nothing downloaded"):
        export_accelerate(url, tmp_path / "out", storage_options=s3_options)
    assert fetched == [] and not (tmp_path / "out").exists()


def test_a_fresh_machine_that_does_not_resume_is_refused_at_its_first_save_and_start_over_sets_aside(tmp_path):
    url = f"file://{tmp_path}/remote/run"
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "m1", remote_url=url).register(acc):
        train(acc, *parts, start=0, stop=12, save_every=6)
    remote = Path(f"{tmp_path}/remote/run")
    before = {p.relative_to(remote): p.read_bytes() for p in remote.rglob("*") if p.is_file() and p.name != ".lease.json"}
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "m2", remote_url=url).register(acc):  # no hook.resume(): from scratch
        with pytest.raises(ConfigError, match=r"newest step 12.*hook\.resume\(\).*start_over=True"):
            train(acc, *parts, start=0, stop=6, save_every=6)
    after = {p.relative_to(remote): p.read_bytes() for p in remote.rglob("*") if p.is_file() and p.name != ".lease.json"}
    assert after == before
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "m2", remote_url=url).register(acc) as hook:  # resumed: goes on
        assert hook.resume() == 12
        train(acc, *parts, start=12, stop=18, save_every=6)
    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "m3", remote_url=url, start_over=True).register(acc):
        train(acc, *parts, start=0, stop=6, save_every=6)
    with CheckpointReader(tmp_path / "r", remote_url=url) as reader:
        assert [c.step for c in reader.list("remote")] == [6]
        assert [c.step for c in reader.abandoned("remote")] == [6, 12, 18]
