"""Hostile or corrupt things in ``local_dir`` and on the remote (issue 40, items 1 to 3): planted links are
never written through nor followed, stray names never stop a load, corrupt side files and lease objects
are read as unreadable, and the CLI's one-line error covers every exception."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import pytest
import torch
from click.testing import CliRunner

from persist_core import (
    CheckpointEngine,
    CheckpointReader,
    ConfigError,
    KeepLastN,
    layout,
)
from persist_core.cli import main
from persist_core.layout import HISTORY_NAME, LEASE_NAME, RUN_ID_NAME, UNSYNCED_NAME
from persist_core.tiers.remote import RemoteTier

PRECIOUS = b"someone else's file\n"


def state_for(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def saved(root, *steps: int, **kw) -> None:
    with CheckpointEngine(root, **kw) as engine:
        for step in steps:
            engine.save(state_for(step), step=step)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture
def no_launcher_run_id(monkeypatch):
    for name in ("PERSIST_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def memory_url() -> str:
    return f"memory:///hardening-{uuid.uuid4().hex[:10]}"


def warnings_naming(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ---------------------------------------------------------------- 1. links planted in local_dir


def test_a_link_at_the_writer_lock_is_an_error_naming_it_and_its_target_is_untouched(tmp_path, victim):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim, root / ".lock-rank-00000")
    with pytest.raises(ConfigError, match=r"\.lock-rank-00000.*symbolic link"):
        CheckpointEngine(root)
    assert victim.read_bytes() == PRECIOUS


def test_a_link_at_the_unsynced_records_temporary_is_never_written_through(tmp_path, victim, caplog):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim, root / ".unsynced.json.tmp")
    with CheckpointEngine(root, remote_url=memory_url(), run_id="job") as engine:
        engine.save(state_for(1), step=1).wait()  # the save and its upload are fine: the record is best effort
    assert victim.read_bytes() == PRECIOUS
    assert warnings_naming(caplog, ".unsynced.json.tmp")


def test_a_link_at_the_run_ids_temporary_is_an_error_naming_it(tmp_path, victim, no_launcher_run_id):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim, root / ".run-id.tmp")
    with pytest.raises(ConfigError, match=r"\.run-id\.tmp.*symbolic link"):
        CheckpointEngine(root, remote_url=memory_url())
    assert victim.read_bytes() == PRECIOUS


def test_a_link_at_the_history_is_never_appended_to_and_said_once(tmp_path, victim, caplog):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim, root / HISTORY_NAME)
    saved(root, 1, 2, 3)
    assert victim.read_bytes() == PRECIOUS
    assert len(warnings_naming(caplog, HISTORY_NAME)) == 1
    assert CliRunner().invoke(main, ["stats", str(root)]).exit_code == 0  # the checkpoints' own numbers


def test_a_leftover_temporary_from_a_crash_is_replaced(tmp_path, no_launcher_run_id):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".run-id.tmp").write_text("half written")
    (root / ".unsynced.json.tmp").write_text("{")
    with CheckpointEngine(root, remote_url=memory_url()) as engine:
        engine.save(state_for(1), step=1).wait()
    assert (root / RUN_ID_NAME).read_text().startswith("run-")
    assert json.loads((root / UNSYNCED_NAME).read_text())["steps"] == []
    assert not (root / ".run-id.tmp").exists() and not (root / ".unsynced.json.tmp").exists()


@pytest.fixture
def linked_step(tmp_path):
    """``ckpt/step-000000000009``: a link to a real checkpoint in another directory."""
    elsewhere = tmp_path / "elsewhere"
    saved(elsewhere, 9)
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(elsewhere / "step-000000000009", root / "step-000000000009")
    return root, elsewhere / "step-000000000009"


def _untouched(root, target) -> None:
    link = root / "step-000000000009"
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "manifest.json").exists()
    assert not [p for p in os.listdir(root) if p.startswith(".tmp-")]


def test_a_linked_checkpoint_directory_is_skipped_by_saves_retention_and_loads_with_one_warning(linked_step, caplog):
    root, target = linked_step
    with CheckpointEngine(root, keep_local=KeepLastN(1)) as engine:
        for step in (1, 2, 3):
            engine.save(state_for(step), step=step).wait()  # retention after each commit: never the link
        assert engine.load()["step"] == 3
    with CheckpointReader(root) as reader:
        assert [c.step for c in reader.list()] == [3]
        assert reader.load()["step"] == 3
    _untouched(root, target)
    assert len(warnings_naming(caplog, str(root / "step-000000000009"))) == 1


def test_persist_gc_and_rm_leave_a_linked_checkpoint_directory_alone(linked_step):
    root, target = linked_step
    saved(root, 1, 2)
    gc = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--incomplete-older-than", "0"])
    assert gc.exit_code == 0, gc.output
    rm = CliRunner().invoke(main, ["rm", str(root), "--step", "9", "--force"])
    assert rm.exit_code == 2 and "no committed checkpoint for step(s) [9]" in rm.output
    _untouched(root, target)
    ls = CliRunner().invoke(main, ["ls", str(root), "--json"])
    assert [r["step"] for r in json.loads(ls.output)] == [2]


def test_linked_temporaries_are_not_ours_to_remove(tmp_path):
    root = tmp_path / "ckpt"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    root.mkdir()
    os.symlink(elsewhere, root / ".tmp-step-000000000001-pid1-abcdef")
    saved(root, 1)
    gc = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--incomplete-older-than", "0"])
    assert gc.exit_code == 0, gc.output
    assert (root / ".tmp-step-000000000001-pid1-abcdef").is_symlink() and (elsewhere / "keep").exists()


# ---------------------------------------------------------------- 2. names: only what round-trips is a checkpoint


STRAYS = {
    "unicode digits": "step-" + "\u0660" * 11 + "\u0661\u0667",
    "trailing newline": "step-000000000017\n",
    "13-digit twin of a newer step": "step-0000000000017",
    "13-digit twin of the good step": "step-0000000000016",
}


@pytest.mark.parametrize("stray", STRAYS.values(), ids=STRAYS.keys())
def test_a_stray_name_never_stops_a_load(tmp_path, stray):
    root = tmp_path / "ckpt"
    saved(root, 15, 16)
    shutil.copytree(root / "step-000000000016", root / stray)  # it even holds a manifest
    with CheckpointEngine(root) as engine:
        assert engine.load()["step"] == 16
    with CheckpointReader(root) as reader:
        assert [c.step for c in reader.list()] == [15, 16]
        assert reader.load()["step"] == 16
    ls = CliRunner().invoke(main, ["ls", str(root), "--json"])
    assert ls.exit_code == 0, ls.output
    assert [r["step"] for r in json.loads(ls.output)] == [15, 16]


@pytest.mark.parametrize("step", [0, 1, 10**12 - 1, 10**12, 10**15 + 7, layout.MAX_STEP])
def test_every_supported_step_round_trips(step):
    assert layout.parse_checkpoint_dirname(layout.checkpoint_dirname(step)) == step
    tmp = layout.tmp_dirname(step, 4242, "1a2b3c")
    assert layout.parse_tmp_dirname(tmp) == (step, 4242)
    assert layout.parse_abandoned_dirname(layout.abandoned_dirname(step, 5, "9f8e7d")) == (step, 5)
    assert len(layout.owner_filename(tmp)) < 255 and len(layout.abandoned_dirname(step, step, "9f8e7d")) < 255


@pytest.mark.parametrize("parse, name", [
    (layout.parse_checkpoint_dirname, "step-000000000001\n"),
    (layout.parse_checkpoint_dirname, "step-00000000001"),  # too few digits
    (layout.parse_checkpoint_dirname, "step-" + str(layout.MAX_STEP + 1)),
    (layout.parse_tmp_dirname, ".tmp-step-000000000001-pid0042-1a2b3c"),
    (layout.parse_tmp_dirname, ".tmp-step-000000000001-pid42-1a2b3c\n"),
    (layout.parse_tmp_dirname, ".tmp-step-00000000000\u0661-pid42-1a2b3c"),
    (layout.parse_abandoned_dirname, "abandoned-step-000000000003-at-000000000002-9f8e7d\n"),
    (layout.parse_abandoned_dirname, "abandoned-step-0000000000003-at-000000000002-9f8e7d"),
    (layout.parse_lock_filename, ".lock-rank-00000\n"),
    (layout.parse_lock_filename, ".lock-rank-000000"),
    (layout.parse_lock_filename, ".lock-rank-0000\u0661"),
    (layout.parse_shard_filename, "rank-0000\u0661.safetensors"),
    (layout.parse_shard_filename, "rank-000001.ckpt"),
])
def test_a_name_that_does_not_round_trip_is_not_ours(parse, name):
    assert parse(name) is None


def test_a_step_past_the_largest_is_a_config_error_at_save_and_steps_past_10_to_the_12_work(tmp_path):
    with CheckpointEngine(tmp_path / "big") as engine:
        engine.save(state_for(10**12 + 3), step=10**12 + 3).wait()  # more digits past 10**12: a step like any
        assert engine.load()["step"] == 10**12 + 3
    assert [p.name for p in (tmp_path / "big").glob("step-*")] == ["step-1000000000003"]
    with CheckpointEngine(tmp_path / "huge") as engine:
        with pytest.raises(ConfigError, match=rf"step={layout.MAX_STEP + 1} .*MAX_STEP={layout.MAX_STEP}"):
            engine.save(state_for(1), step=layout.MAX_STEP + 1)
        with pytest.raises(ConfigError, match=r"step=1180591620717411303424 "):
            engine.save(state_for(1), step=2**70)
    assert not list((tmp_path / "huge").glob("*step-*"))


@pytest.mark.xfail(strict=True, reason="CheckpointEngine.save must check the step (layout.check_step) before "
                                       "Timeline.check records it as the newest: engine.py, edited elsewhere")
def test_after_a_step_past_the_largest_the_engine_saves_normal_steps(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        with pytest.raises(ConfigError):
            engine.save(state_for(1), step=2**70)
        engine.save(state_for(1), step=1).wait()
