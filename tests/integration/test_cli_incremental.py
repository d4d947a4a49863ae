"""The ``persist`` command with incremental checkpoints (issue 43) on a ``file://`` remote: ``pull``, ``cp``,
``sync`` and ``push`` bring what a checkpoint references along (before it), ``verify`` follows references (a
checkpoint is bad when what it references is), ``export`` loads a referencing checkpoint from the remote, and ``du``
shows own and shared bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main
from persist_core.tiers.local import committed_steps, read_manifest
from tests.support.states import assert_state_equal

BASE = 1 << 18  # float32 elements of the frozen base: 1 MiB


def _state(step: int) -> dict:
    base = torch.randn(BASE, generator=torch.Generator().manual_seed(1234))
    adapter = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    return {"model": {"base": base, "adapter": adapter}, "optim": {"exp_avg": adapter * 0.1}, "step": step}


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def remote(tmp_path) -> str:
    """A file:// remote an incremental run uploaded steps 1 (full), 2 and 3 (each referencing 1) to."""
    url = (tmp_path / "remote").as_uri()
    with CheckpointEngine(tmp_path / "run", remote_url=url, incremental=True, direct_io="off") as engine:
        for step in (1, 2, 3):
            engine.save(_state(step), step=step)
    return url


def test_pull_brings_what_a_checkpoint_references_first_and_it_loads_bit_exact(tmp_path, remote):
    out = run("pull", remote, str(tmp_path / "here"), "--step", "3", "--json")
    assert out.exit_code == 0, out.output
    assert committed_steps(tmp_path / "here") == [1, 3]
    assert read_manifest(tmp_path / "here" / f"step-{3:012d}").depends_on() == {1}
    with CheckpointReader(tmp_path / "here") as reader:
        assert_state_equal(reader.load(step=3), _state(3))
        assert not reader.loaded_from_remote


def test_cp_and_sync_to_another_remote_upload_the_referenced_checkpoint_first(tmp_path, remote):
    other = (tmp_path / "other").as_uri()
    assert run("cp", remote, other, "--step", "2", "--quiet").exit_code == 0
    with CheckpointReader(tmp_path / "fresh", remote_url=other) as reader:
        assert [c.step for c in reader.list("remote")] == [1, 2]
        assert_state_equal(reader.load(step=2), _state(2))
    third = (tmp_path / "third").as_uri()
    done = run("sync", str(tmp_path / "run"), third, "--json")  # local -> remote: every step, 1 first
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["copied"] == [1, 2, 3]
    with CheckpointReader(tmp_path / "fresh3", remote_url=third) as reader:
        assert_state_equal(reader.load(step=3), _state(3))
    local = tmp_path / "synced"
    assert run("sync", remote, str(local), "--quiet").exit_code == 0  # remote -> local
    assert committed_steps(local) == [1, 2, 3]


def test_push_refuses_a_checkpoint_whose_reference_is_on_neither_side(tmp_path, remote):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copytree(tmp_path / "run" / f"step-{2:012d}", partial / f"step-{2:012d}")
    out = run("push", str(partial), (tmp_path / "empty").as_uri())
    assert out.exit_code != 0 and "references step(s) [1]" in out.output
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


def test_verify_follows_references(tmp_path, remote):
    ok = run("verify", remote, "--json")
    assert ok.exit_code == 0, ok.output
    one = run("verify", remote, "--step", "3", "--json")  # what 3 references is verified with it
    assert [c["step"] for c in json.loads(one.output)["checkpoints"]] == [1, 3]
    shard = next((tmp_path / "remote" / f"step-{1:012d}").glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # a byte of the base, referenced by 2 and 3
    shard.write_bytes(bytes(raw))
    bad = run("verify", remote, "--step", "3", "--json")
    report = {c["step"]: c["ok"] for c in json.loads(bad.output)["checkpoints"]}
    assert bad.exit_code == 1 and report == {1: False, 3: True}  # 3's own bytes are good; the run fails on 1
    (tmp_path / "remote" / f"step-{1:012d}" / "manifest.json").unlink()  # what 3 references is gone
    gone = run("verify", remote, "--step", "3")
    assert gone.exit_code == 1 and "references bytes of step 1" in gone.output


def test_export_of_a_referencing_checkpoint_from_the_remote(tmp_path, remote):
    out = tmp_path / "model.safetensors"
    assert run("export", remote, "--step", "3", "--format", "safetensors", "--to", str(out)).exit_code == 0
    got = load_file(str(out))
    assert got["model/base"].equal(_state(3)["model"]["base"]) and got["model/adapter"].equal(_state(3)["model"]["adapter"])
    whole = tmp_path / "state.pt"
    assert run("export", remote, "--step", "2", "--to", str(whole)).exit_code == 0
    assert_state_equal(torch.load(whole, weights_only=True), _state(2))


def test_du_shows_own_and_shared_bytes(tmp_path, remote):
    report = json.loads(run("du", remote, "--json").output)["full"]
    assert report["checkpoints"] == 3 and report["referencing"] == 2
    assert report["shared_bytes"] == 2 * 4 * BASE  # steps 2 and 3 each reference the 1 MiB base
    assert 4 * BASE < report["bytes"] < 4 * BASE + 3 * 64 * 1024  # the base once, and each step's own small shard
    text = run("du", str(tmp_path / "run")).output
    assert "2 incremental reference 2.1 MB more" in text, text


def test_rm_and_gc_on_the_remote_keep_what_a_staying_checkpoint_references(tmp_path, remote):
    refused = run("rm", remote, "--step", "1")
    assert refused.exit_code != 0 and "reference" in refused.output and "[2, 3]" in refused.output, refused.output
    kept = run("gc", remote, "--keep-last", "1")
    assert kept.exit_code == 0, kept.output
    assert "kept step 1: referenced by step(s) [3]" in kept.output
    with CheckpointReader(tmp_path / "fresh", remote_url=remote) as reader:
        assert [c.step for c in reader.list("remote")] == [1, 3]
        assert_state_equal(reader.load(), _state(3))
