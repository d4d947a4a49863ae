"""The ``persist`` command through its real entry point, on a local directory and the moto S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main
from persist_core.tiers.local import read_manifest
from tests.support.states import assert_state_equal
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(300, 300), random=True, bias=torch.float32)


def run(*args: str, options: dict | None = None):
    pre = ["--storage-options", json.dumps(options)] if options else []
    return CliRunner().invoke(main, [*pre, *args], catch_exceptions=False)


@pytest.fixture
def local(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    with CheckpointEngine(d) as engine:
        for step in (10, 20, 30, 40):
            engine.save(state_for(step), step=step)
    return d


@pytest.fixture
def remote(local, bucket, s3_options) -> str:
    url = f"s3://{bucket}/run"
    assert run("push", str(local), url, "--quiet", options=s3_options).exit_code == 0
    return url


@pytest.mark.parametrize("where", ["local", "remote"])
def test_ls_inspect_and_verify(where, local, remote, s3_options, tmp_path):
    location, options = (str(local), None) if where == "local" else (remote, s3_options)
    listing = run("ls", location, "--json", "--milestones", "20", options=options)
    assert listing.exit_code == 0, listing.output
    rows = json.loads(listing.output)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert [r["milestone"] for r in rows] == [False, True, False, True]
    assert "│   40 │" in run("ls", location, options=options).output  # the table
    tree = json.loads(run("inspect", location, "--step", "20", "--json", options=options).output)
    assert {e["name"]: e["shape"] for e in tree["entries"] if e["shape"]} == {"model/w": [300, 300], "model/b": [300]}
    checked = run("verify", location, options=options)
    assert checked.exit_code == 0 and checked.output.count(": OK") == 4


def test_verify_names_a_flipped_byte_and_a_missing_file(local):
    shard = local / "step-000000000020" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run("verify", str(local), "--step", "20")
    assert result.exit_code == 1 and "step-000000000020/rank-00000.safetensors: chunk 0" in result.output
    (local / "step-000000000030" / "rank-00000.safetensors").unlink()
    result = run("verify", str(local))
    assert result.exit_code == 1
    # a checkpoint missing a file is not listed as committed, but verify names it (before: "OK" for the rest, exit 1
    # only because of step 20)
    assert "step 30: BAD" in result.output and "step-000000000030/rank-00000.safetensors" in result.output
    assert "step 20: BAD" in result.output and result.output.count(": OK") == 2  # 10 and 40


@pytest.mark.parametrize("damage", ["truncated shard", "unreadable manifest", "missing shard"])
def test_verify_exits_1_for_every_directory_that_claims_to_be_a_checkpoint_and_is_not(local, damage):
    ckpt = local / "step-000000000030"
    if damage == "truncated shard":
        shard = ckpt / "rank-00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:-4096])
    elif damage == "unreadable manifest":
        (ckpt / "manifest.json").write_bytes(b"{not json")
    else:
        (ckpt / "rank-00000.safetensors").unlink()
    result = run("verify", str(local))
    assert result.exit_code == 1 and "step 30: BAD" in result.output, result.output


def test_gc_refuses_a_negative_age_for_incomplete_directories(local):
    result = run("gc", str(local), "--keep-last", "1", "--incomplete-older-than", "-1")
    assert result.exit_code == 2 and "must be >= 0" in result.output


def test_verify_catches_a_corrupt_remote_object(remote, s3_options):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    key = f"{remote[len('s3://'):]}/step-000000000040/rank-00000.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-5000] ^= 1
    fs.pipe_file(key, bytes(data))
    result = run("verify", remote, "--step", "40", options=s3_options)
    block = (len(data) - 5000) // (256 << 10)  # the flipped byte's 256 KiB checksum block
    assert result.exit_code == 1 and f"step-000000000040/rank-00000.safetensors: chunk {block} (bytes" in result.output


def test_pull_push_round_trip(remote, s3_options, tmp_path):
    result = run("pull", remote, str(tmp_path / "fresh"), "--step", "30", options=s3_options)
    assert result.exit_code == 0, result.output
    assert_state_equal(CheckpointReader(tmp_path / "fresh").load(30), state_for(30))
    again = run("push", str(tmp_path / "fresh"), remote, options=s3_options)
    assert "has every committed checkpoint" in again.output
    pushed = run("push", str(tmp_path / "fresh"), remote + "-copy", "--json", options=s3_options)
    report = json.loads(pushed.output)  # nothing but the report on stdout
    assert report["pushed"] == [30] and report["bytes"] == read_manifest(tmp_path / "fresh" / "step-000000000030").nbytes
    listed = json.loads(run("ls", remote + "-copy", "--json", options=s3_options).output)
    assert [r["step"] for r in listed] == [30]
    share = run("push", str(tmp_path / "fresh"), f"file://{tmp_path / 'share'}")  # a remote on a mounted share
    assert share.exit_code == 0 and "pushed 1 checkpoint: " in share.output, share.output
    assert (tmp_path / "share" / "step-000000000030" / "manifest.json").exists()
    wrong = run("push", str(tmp_path / "fresh"), str(tmp_path / "share"))
    assert wrong.exit_code == 2 and "then a remote URL" in wrong.output


def test_gc_dry_run_deletes_nothing_then_gc_keeps_policy_and_newest(local, tmp_path):
    (local / ".tmp-step-000000000050-pid999999-abcdef").mkdir()  # a crashed writer's leftovers
    os.utime(local / ".tmp-step-000000000050-pid999999-abcdef", (0, 0))
    (local / ".node-probe-0123abcd-rank-1").write_bytes(b"")  # a first save killed while finding the nodes
    os.utime(local / ".node-probe-0123abcd-rank-1", (0, 0))
    (local / ".node-probe-4567cdef-rank-1").write_bytes(b"")  # a live job's first save, right now
    before = sorted(p.name for p in local.iterdir())
    dry = run("gc", str(local), "--keep-last", "1", "--keep-every-n-steps", "20", "--dry-run")
    assert dry.exit_code == 0 and "would remove step 10" in dry.output and "would remove step 30" in dry.output
    assert "would remove incomplete" in dry.output
    assert sorted(p.name for p in local.iterdir()) == before
    done = run("gc", str(local), "--keep-last", "1", "--keep-every-n-steps", "20")
    assert done.exit_code == 0
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["step-000000000020", "step-000000000040"]
    assert sorted(p.name for p in local.iterdir() if p.name.startswith(".node-probe")) == [".node-probe-4567cdef-rank-1"]
    assert run("gc", str(local)).exit_code == 2  # nothing to keep said: a usage error


def test_gc_on_the_remote(remote, s3_options):
    assert run("gc", remote, "--keep-last", "2", options=s3_options).exit_code == 0
    rows = json.loads(run("ls", remote, "--json", options=s3_options).output)
    assert [r["step"] for r in rows] == [30, 40]


def test_export_torch_file_loads(local, remote, s3_options, tmp_path):
    assert run("export", str(local), "--step", "20", "--to", str(tmp_path / "a.pt")).exit_code == 0
    assert_state_equal(torch.load(tmp_path / "a.pt"), state_for(20))
    assert run("export", remote, "--to", str(tmp_path / "b.pt"), options=s3_options).exit_code == 0
    assert_state_equal(torch.load(tmp_path / "b.pt"), state_for(40))
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    key = f"{remote[len('s3://'):]}/step-000000000030/rank-00000.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-100] ^= 1
    fs.pipe_file(key, bytes(data))
    bad = run("export", remote, "--step", "30", "--to", str(tmp_path / "c.pt"), options=s3_options)
    assert bad.exit_code == 2 and "checksum" in bad.output
    assert sorted(p.name for p in tmp_path.iterdir() if "c.pt" in p.name) == []  # no file, no download left


def test_errors_are_one_line_with_exit_2(tmp_path):
    result = run("ls", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "is not a directory" in result.output
    (tmp_path / "empty").mkdir()
    result = run("verify", str(tmp_path / "empty"))
    assert result.exit_code == 2 and result.output.strip().startswith("Error: no committed checkpoint")
    assert run("--storage-options", "{nope", "ls", str(tmp_path)).exit_code == 2


def test_the_console_script(local):
    exe = Path(sys.executable).with_name("persist")
    result = subprocess.run([str(exe), "ls", str(local), "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in json.loads(result.stdout)] == [10, 20, 30, 40]


@pytest.mark.parametrize("where", ["local", "remote"])
def test_gc_never_removes_the_newest_checkpoint_that_verifies(where, local, remote, s3_options):
    """The two newest are corrupt: --keep-last 2 must not delete the only good one (issue 19 item 6)."""
    location, options = (str(local), None) if where == "local" else (remote, s3_options)
    for step in (30, 40):  # flip a byte in the shard of each: sizes still check, checksums do not
        if where == "local":
            shard = local / f"step-{step:012d}" / "rank-00000.safetensors"
            raw = bytearray(shard.read_bytes())
            raw[-100] ^= 0xFF
            shard.write_bytes(raw)
        else:
            from persist_core.tiers.remote import RemoteTier

            tier = RemoteTier(remote, s3_options)
            path = tier.path_of(f"step-{step:012d}/rank-00000.safetensors")
            raw = bytearray(tier.fs.cat_file(path))
            raw[-100] ^= 0xFF
            tier.fs.pipe_file(path, bytes(raw))
    result = run("gc", location, "--keep-last", "2", options=options)
    assert result.exit_code == 0, result.output
    assert "kept step 20: the newest checkpoint that verifies" in result.output
    assert "removed step 10" in result.output and "removed step 20" not in result.output
    listing = json.loads(run("ls", location, "--json", options=options).output)
    assert [r["step"] for r in listing] == [20, 30, 40]
    assert "--keep-last" in run("gc", "--help").output and "verifies" in run("gc", "--help").output


def _damage(location: str, step: int, options: dict | None, *, truncate: bool) -> None:
    """Flip a byte near the end of ``step``'s shard (its size still checks) or cut its last 100 bytes."""
    from persist_core.tiers.remote import RemoteTier

    name = f"step-{step:012d}/rank-00000.safetensors"
    if options is None:
        shard = Path(location) / name
        raw = bytearray(shard.read_bytes())
    else:
        tier = RemoteTier(location, options)
        raw = bytearray(tier.fs.cat_file(tier.path_of(name)))
    if truncate:
        del raw[-100:]
    else:
        raw[-100] ^= 0xFF
    if options is None:
        shard.write_bytes(bytes(raw))
    else:
        tier.fs.pipe_file(tier.path_of(name), bytes(raw))


@pytest.mark.parametrize("where", ["local", "remote"])
def test_gc_keep_last_counts_only_checkpoints_that_check(where, local, remote, s3_options):
    """``--keep-last 2`` keeps two good checkpoints: one whose file lost bytes is not counted (a cheap check, on S3
    too), one with a flipped byte is not counted under ``--verify``; neither is removed; --dry-run says why (issue 44)."""
    location, options = (str(local), None) if where == "local" else (remote, s3_options)
    _damage(location, 40, options, truncate=True)
    dry = run("gc", location, "--keep-last", "2", "--dry-run", "--json", options=options)
    assert dry.exit_code == 0, dry.output
    report = json.loads(dry.output)
    assert report["removed"] == [10]  # 20 and 30 are the two that count
    assert [n["step"] for n in report["not_counted"]] == [40] and "the manifest says" in report["not_counted"][0]["why"]
    text = run("gc", location, "--keep-last", "2", "--dry-run", options=options).output
    assert "would remove step 10" in text and "not counted step 40" in text and "persist rm" in text
    _damage(location, 30, options, truncate=False)
    cheap = json.loads(run("gc", location, "--keep-last", "2", "--dry-run", "--json", "--no-verify",
                           options=options).output)
    assert cheap["removed"] == [10]  # sizes check: 30 counts without --verify
    full = run("gc", location, "--keep-last", "2", "--verify", options=options)
    assert full.exit_code == 0, full.output
    assert "not counted step 30" in full.output and "not counted step 40" in full.output
    assert "removed step" not in full.output  # 10 and 20 are the two good ones: kept
    listing = json.loads(run("ls", location, "--json", options=options).output)
    assert [r["step"] for r in listing] == [10, 20, 30]  # 40 is not listed (it does not check); nothing removed
    both = run("gc", location, "--keep-last", "2", "--verify", "--no-verify", options=options)
    assert both.exit_code == 2 and "--verify" in both.output


@pytest.mark.parametrize("where", ["local", "remote"])
def test_ls_where_there_is_no_checkpoint_says_so_and_names_the_runs_below(where, local, remote, s3_options, tmp_path):
    """A bucket root or a parent directory holds runs, not checkpoints (issue 19 item 1)."""
    if where == "local":
        parent, options = str(local.parent), None
        typo = str(tmp_path / "nope")
        (tmp_path / "nope").mkdir()
    else:
        parent, options = remote.rsplit("/", 1)[0], s3_options
        typo = remote + "-typo"
    listing = run("ls", parent, options=options)
    assert listing.exit_code == 0, listing.output
    assert f"no checkpoints under {parent}" in listing.output
    assert "ckpt" in listing.output if where == "local" else "run" in listing.output
    assert "40" in listing.output and "4 checkpoints" in listing.output  # the run's newest step and count
    empty = run("ls", typo, options=options)
    assert empty.exit_code == 1 and f"no checkpoints under {typo}" in empty.output


def test_verify_closes_with_a_total_and_speaks_json(local):
    text = run("verify", str(local))
    assert text.exit_code == 0
    assert "4 checkpoints verified" in text.output and "MB/s" in text.output
    report = json.loads(run("verify", str(local), "--json").output)
    assert [r["step"] for r in report["checkpoints"]] == [10, 20, 30, 40]
    assert all(r["ok"] for r in report["checkpoints"]) and report["bad"] == 0 and report["bytes"] > 0


def test_pull_closes_with_size_time_and_rate_and_push_draws_no_bar_for_no_work(local, remote, s3_options, tmp_path,
                                                                                monkeypatch):
    pulled = run("pull", remote, str(tmp_path / "pulled"), "--step", "20", options=s3_options)
    assert pulled.exit_code == 0, pulled.output
    assert "step 20 -> " in pulled.output and " in " in pulled.output and "MB/s)" in pulled.output
    nothing = run("push", str(local), remote, options=s3_options)  # the remote has everything already
    assert nothing.exit_code == 0 and "has every committed checkpoint" in nothing.output
    import io

    import persist_core.cli.app as cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(cli.sys, "stderr", Terminal())
    with cli.progress(0, "push 0 checkpoint(s)", quiet=False) as bar:
        assert bar._progress is None  # no 0/0 bar for no work
    with cli.progress(10, "push 1 checkpoint(s)", quiet=False) as bar:
        assert bar._progress is not None
        bar.echo("step 1 -> somewhere")  # printed through the bar's console, above it
        bar(10)


def test_inspect_shows_scalars_bytes_subtree_totals_depth_and_filter(tmp_path):
    d = tmp_path / "ckpt"
    with CheckpointEngine(d) as engine:
        engine.save({"model": {"w": torch.zeros(10, 10), "b": torch.zeros(10, dtype=torch.float64)},
                     "optim": {"lr": 0.001, "betas": (0.9, 0.99)}, "step": 600, "note": {1, 2}}, step=600)
    rows = {e["name"]: e for e in json.loads(run("inspect", str(d), "--json").output)["entries"]}
    assert rows["step"]["value"] == 600 and rows["optim/lr"]["value"] == 0.001 and rows["optim/betas/1"]["value"] == 0.99
    assert rows["model/w"]["bytes"] == 400 and rows["model/b"]["bytes"] == 80 and rows["note"]["dtype"] == "pickled"
    shallow = {e["name"]: e for e in json.loads(run("inspect", str(d), "--json", "--depth", "1").output)["entries"]}
    assert shallow["model"]["bytes"] == 480 and shallow["model"]["dtype"] == "subtree (2 entries)"
    assert "model/w" not in shallow and shallow["step"]["value"] == 600
    only = json.loads(run("inspect", str(d), "--json", "--filter", "model/*").output)["entries"]
    assert [e["name"] for e in only] == ["model/w", "model/b"]
    table = run("inspect", str(d)).output
    assert "600" in table and "bytes" in table and "400 B" in table


def test_ls_on_the_remote_makes_one_listing_and_reads_each_manifest_once(tmp_path, monkeypatch):
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    url = f"memory:///cli-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        for step in (1, 2, 3):
            engine.save({"w": torch.full((64,), float(step))}, step=step).wait()
    calls: list[str] = []
    for name in ("ls", "find", "cat_file", "info"):
        real = getattr(MemoryFileSystem, name)
        monkeypatch.setattr(MemoryFileSystem, name,
                            lambda self, *a, _n=name, _r=real, **k: (calls.append(_n), _r(self, *a, **k))[1])
    done = CliRunner().invoke(main, ["ls", "--json", url])
    assert done.exit_code == 0, done.output
    assert [r["step"] for r in json.loads(done.output)] == [1, 2, 3]
    manifests = calls.count("cat_file")
    assert manifests == 3, calls  # one read per manifest, none twice
    assert calls.count("ls") <= 1, calls  # no listing per checkpoint (the weights-only prefix may be listed once)


def test_version_global_options_after_the_command_and_s3_options_as_the_aws_tools_spell_them(
        tmp_path, bucket, s3_endpoint):
    persist = Path(sys.executable).with_name("persist")
    done = subprocess.run([persist, "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("persist, version "), done.stdout + done.stderr
    url = f"s3://{bucket}/run"
    with CheckpointEngine(tmp_path / "a", remote_url=url,
                          storage_options={"client_kwargs": {"endpoint_url": s3_endpoint}}) as engine:
        engine.save({"w": torch.ones(8)}, step=5).wait()
    for args in (["--endpoint-url", s3_endpoint, "ls", "--json", url],  # before the command, as usual
                 ["ls", url, "--json", "--endpoint-url", s3_endpoint, "--region", "us-east-1"],  # after it, as aws
                 ["du", "--json", url, f"--endpoint-url={s3_endpoint}"]):
        done = subprocess.run([persist, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (args, done.stdout + done.stderr)
        out = json.loads(done.stdout)
        if args[0] == "du":
            assert out["full"]["checkpoints"] == 1 and out["bytes"] > 0
        else:
            assert [r["step"] for r in out] == [5]
    done = subprocess.run([persist, "ls", "--help"], capture_output=True, text=True)
    assert "Example:" in done.stdout and "persist ls s3://bucket/run-7" in done.stdout


def _three_saves(d: Path) -> str:
    """Steps 1, 2, 3 saved into ``d`` and uploaded to a fresh memory:// remote; its URL."""
    import uuid

    url = f"memory:///cli-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(d, remote_url=url) as engine:
        for step in (1, 2, 3):
            engine.save({"w": torch.full((8,), float(step))}, step=step).wait()
    return url


def test_rm_refuses_the_newest_and_what_is_not_uploaded_unless_forced(tmp_path):
    d = tmp_path / "ckpt"
    url = _three_saves(d)
    runner = CliRunner()
    done = runner.invoke(main, ["rm", str(d), "--step", "3"])
    assert done.exit_code == 2 and "newest committed" in done.output and "--force" in done.output
    done = runner.invoke(main, ["rm", str(d), "--step", "9"])
    assert done.exit_code == 2 and "no committed checkpoint for step(s) [9]" in done.output
    (d / ".unsynced.json").write_text(json.dumps({"remote": url, "steps": [2], "updated": 0}))  # say 2 waits
    done = runner.invoke(main, ["rm", str(d), "--step", "2"])
    assert done.exit_code == 2 and "not uploaded" in done.output
    done = runner.invoke(main, ["rm", str(d), "--step", "1", "--json"])
    assert done.exit_code == 0 and json.loads(done.output)["removed"] == [1]
    with CheckpointReader(d) as reader:
        assert [c.step for c in reader.list()] == [2, 3]
    done = runner.invoke(main, ["rm", url, "--step", "3", "--force"])  # the remote's, forced
    assert done.exit_code == 0, done.output
    with CheckpointReader(tmp_path / "other", remote_url=url) as reader:
        assert [c.step for c in reader.list("remote")] == [1, 2]
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp")]


def test_stats_shows_what_each_save_cost_plots_it_and_says_when_saves_are_too_frequent(
        tmp_path, bucket, s3_endpoint):
    import matplotlib.image

    from persist_core.report import verdict as _verdict

    persist = Path(sys.executable).with_name("persist")
    url, local = f"s3://{bucket}/run", tmp_path / "ckpt"
    with CheckpointEngine(local, remote_url=url,
                          storage_options={"client_kwargs": {"endpoint_url": s3_endpoint}}) as engine:
        for step in (10, 20, 30, 40, 50):
            engine.save({"w": torch.randn(256, 256)}, step=step).wait()
    done = subprocess.run([persist, "stats", str(local), "--json", "--plot", str(tmp_path / "cost.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    rows = report["checkpoints"]
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]
    assert all(r["stall_s"] > 0 and r["durable_s"] >= r["stall_s"] and r["bytes"] > 0 and r["lag_s"] > 0 for r in rows)
    assert rows[0]["interval_s"] is None and all(r["interval_s"] > 0 for r in rows[1:])
    assert report["verdict"].startswith("5 checkpoints, one every")
    png = matplotlib.image.imread(tmp_path / "cost.png")  # the picture: its size, and its series' colours
    assert png.shape[:2] == (450, 900)
    rgb = (png[..., :3] * 255).round()
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)):  # 4 series: matplotlib's first 4
        assert ((abs(rgb - colour) < 8).all(axis=-1)).sum() > 50, colour
    # the remote: its manifests only (when, how big), through the same command
    done = subprocess.run([persist, "stats", url, "--json", "--endpoint-url", s3_endpoint], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    remote_rows = json.loads(done.stdout)["checkpoints"]
    assert [r["step"] for r in remote_rows] == [10, 20, 30, 40, 50] and "stall_s" not in remote_rows[0]
    # the verdict when a new save starts before the last is twice its own duration old
    frequent = [{"step": s, "time": float(s), "interval_s": None if s == 0 else 1.0, "durable_s": 1.5, "stall_s": 0.1}
                for s in range(5)]
    assert "Saves are too frequent for this state" in _verdict(frequent) and "every 3.0 s" in _verdict(frequent)
    done = subprocess.run([persist, "stats", str(tmp_path / "empty")], capture_output=True, text=True)
    assert done.returncode == 2


def test_cp_and_sync_between_any_two_locations_verified_manifest_last(tmp_path, bucket, s3_endpoint):
    import uuid

    mem = f"memory:///cli-{uuid.uuid4().hex[:8]}"
    s3 = f"s3://{bucket}/copy"
    src = tmp_path / "src"
    with CheckpointEngine(src) as engine:
        for step in (1, 2, 3):
            engine.save({"w": torch.full((1000,), float(step))}, step=step).wait()
    runner = CliRunner()
    opts = ["--endpoint-url", s3_endpoint]
    done = runner.invoke(main, ["cp", str(src), mem, "--step", "2", "--json"])  # local -> remote
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["copied"] == [2]
    done = runner.invoke(main, ["cp", mem, s3, *opts])  # remote -> remote (the newest: 2)
    assert done.exit_code == 0, done.output
    done = runner.invoke(main, ["cp", s3, str(tmp_path / "back"), *opts])  # remote -> local
    assert done.exit_code == 0, done.output
    with CheckpointReader(tmp_path / "back") as reader:
        assert [c.step for c in reader.list()] == [2]
        assert torch.equal(reader.load()["w"], torch.full((1000,), 2.0))
    done = runner.invoke(main, ["sync", str(src), s3, *opts, "--json"])  # what the target lacks: 1 and 3
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["copied"] == [1, 3]
    done = runner.invoke(main, ["sync", str(src), s3, *opts])
    assert done.exit_code == 0 and "has every committed checkpoint" in done.output
    done = runner.invoke(main, ["cp", str(src), str(tmp_path / "local-copy"), "--step", "3"])  # local -> local
    assert done.exit_code == 0, done.output
    with CheckpointReader(tmp_path / "local-copy") as reader:
        assert torch.equal(reader.load(3)["w"], torch.full((1000,), 3.0))
    done = runner.invoke(main, ["cp", str(src), mem, "--step", "7"])
    assert done.exit_code == 2 and "no committed checkpoint for step 7" in done.output


def test_copying_many_steps_lists_the_source_once_and_opens_each_location_once(tmp_path, monkeypatch):
    import uuid

    from persist_core.tiers.remote import RemoteTier

    mem = f"memory:///cli-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "run", remote_url=mem) as engine:
        for step in range(1, 6):
            engine.save({"w": torch.full((100,), float(step))}, step=step).wait()
    listed, opened = [], []
    list_remote, init_remote = RemoteTier.list, RemoteTier.__init__
    monkeypatch.setattr(RemoteTier, "list", lambda self: listed.append(self.url) or list_remote(self))
    monkeypatch.setattr(RemoteTier, "__init__", lambda self, *a, **k: opened.append(a[0]) or init_remote(self, *a, **k))
    steps = [a for s in range(1, 6) for a in ("--step", str(s))]
    done = CliRunner().invoke(main, ["cp", mem, str(tmp_path / "copy"), *steps, "--json"])  # remote -> local
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["copied"] == [1, 2, 3, 4, 5]
    with CheckpointReader(tmp_path / "copy") as reader:
        assert [c.step for c in reader.list()] == [1, 2, 3, 4, 5]
        assert torch.equal(reader.load(4)["w"], torch.full((100,), 4.0))
    assert listed == [mem] and opened.count(mem) <= 2  # the command's source, and the one reader copying every step
    listed.clear()
    done = CliRunner().invoke(main, ["sync", str(tmp_path / "run"), mem + "-mirror", "--json"])  # local -> remote
    assert done.exit_code == 0 and json.loads(done.output)["copied"] == [1, 2, 3, 4, 5], done.output
    assert opened.count(mem + "-mirror") <= 2  # the target's listing, and one tier uploading every step


def test_gc_and_pull_report_as_json(tmp_path):
    d = tmp_path / "ckpt"
    url = _three_saves(d)
    done = CliRunner().invoke(main, ["gc", str(d), "--keep-last", "1", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["removed"] == [1, 2] and report["dry_run"] is False
    done = CliRunner().invoke(main, ["pull", url, str(tmp_path / "pulled"), "--step", "2", "--json"])
    assert done.exit_code == 0, done.output
    pulled = json.loads(done.output)
    assert pulled["step"] == 2 and pulled["bytes"] > 0 and Path(pulled["path"]).is_dir()
