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
    MemoryTier,
    layout,
)
from persist_core.cli import main
from persist_core.layout import HISTORY_NAME, LEASE_NAME, RUN_ID_NAME, UNSYNCED_NAME
from persist_core.tiers.remote import RemoteTier
from functools import partial
from tests.support import states

PRECIOUS = b"someone else's file\n"


state_for = partial(states.state_for, shape=(4,))


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


def test_after_a_step_past_the_largest_the_engine_saves_normal_steps(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        with pytest.raises(ConfigError):
            engine.save(state_for(1), step=2**70)
        engine.save(state_for(1), step=1).wait()


# ---------------------------------------------------------------- 3. corrupt side files and remote objects


@pytest.mark.parametrize("expires", ['"soon"', "1e300", "Infinity", "NaN", "[1, 2]", "true", "-1e300"])
def test_a_lease_with_an_unreadable_expiry_is_taken_over_and_logged(tmp_path, expires, caplog):
    url = memory_url()
    tier = RemoteTier(url)
    tier.fs.pipe_file(tier.path_of(LEASE_NAME),
                      f'{{"run_id": "other", "host": "h", "pid": 1, "expires": {expires}}}'.encode())
    with CheckpointEngine(tmp_path / "ckpt", remote_url=url, run_id="mine", remote_timeout_s=5) as engine:
        engine.save(state_for(1), step=1).wait()
        assert [c.step for c in engine.list("remote")] == [1]
    assert warnings_naming(caplog, LEASE_NAME)


HISTORY_LINES = {
    "not JSON": "not json",
    "JSON not an object": "[1, 2, 3]",
    "missing keys": '{"event": "committed"}',
    "step of the wrong type": '{"event": "committed", "step": "three", "wall": 3.0, "time": 3.0}',
    "value of the wrong type": '{"event": "committed", "step": 3, "wall": 3.0, "time": 3.0, "stall_s": "slow"}',
    "huge step": '{"event": "committed", "step": 1e999, "wall": 3.0, "time": 3.0}',
    "huge time": '{"event": "committed", "step": 3, "wall": 1e300, "time": 1e300}',
    "huge bytes": '{"event": "committed", "step": 3, "wall": 3.0, "time": 3.0, "bytes": 1e999}',
    "bool step": '{"event": "committed", "step": true, "wall": 3.0, "time": 3.0}',
    "upload of the wrong type": '{"event": "uploaded", "step": 2, "wall": 4.0, "lag_s": "late"}',
}


@pytest.mark.parametrize("bad", HISTORY_LINES.values(), ids=HISTORY_LINES.keys())
def test_persist_stats_skips_bad_history_lines_and_says_so_once(tmp_path, bad):
    good = [{"event": "committed", "step": s, "wall": float(s), "time": float(s), "stall_s": 0.01, "durable_s": 0.2,
             "bytes": 100} for s in (1, 2)]
    (tmp_path / HISTORY_NAME).write_text("".join(json.dumps(g) + "\n" for g in good) + bad + "\n" + bad + "\n")
    for args in ([], ["--json"]):
        result = CliRunner().invoke(main, ["stats", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        assert result.output.count("skipped 2 unreadable lines") == 1, result.output
    rows = json.loads(result.stdout)["checkpoints"]
    assert [r["step"] for r in rows] == [1, 2]


UNSYNCED = {
    "huge step": '{"remote": "s3://b/run", "steps": [1e999]}',
    "fraction": '{"remote": "s3://b/run", "steps": [1.5]}',
    "bool": '{"remote": "s3://b/run", "steps": [true]}',
    "negative": '{"remote": "s3://b/run", "steps": [-1]}',
    "not a list": '{"remote": "s3://b/run", "steps": 7}',
    "remote not a string": '{"remote": 5, "steps": [1]}',
    "not an object": "[1]",
    "not UTF-8": b"\xff\xfe{",
}


@pytest.mark.parametrize("record", UNSYNCED.values(), ids=UNSYNCED.keys())
def test_persist_gc_and_rm_keep_everything_when_the_unsynced_record_is_unreadable(tmp_path, record):
    root = tmp_path / "ckpt"
    saved(root, 1, 2, 3)
    (root / UNSYNCED_NAME).write_bytes(record if isinstance(record, bytes) else record.encode())
    gc = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1"])
    assert gc.exit_code == 0, gc.output
    assert "the record of what is uploaded is unreadable" in gc.output
    rm = CliRunner().invoke(main, ["rm", str(root), "--step", "1"])
    assert rm.exit_code == 2 and "--force" in rm.output, rm.output
    assert sorted(p.name for p in root.glob("step-*")) == [layout.checkpoint_dirname(s) for s in (1, 2, 3)]


def test_a_run_id_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path, no_launcher_run_id):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / RUN_ID_NAME).write_bytes(b"run-\xff\xfe")
    with pytest.raises(ConfigError, match=rf"{RUN_ID_NAME}.*UTF-8"):
        CheckpointEngine(root, remote_url=memory_url())


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("boom"), TypeError("boom"), LookupError()])
def test_the_cli_turns_every_exception_into_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, error):
    from persist_core.tiers.local import LocalTier

    def fail(self):
        raise error

    monkeypatch.setattr(LocalTier, "listing", fail)
    result = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert result.exit_code == 2 and result.exception is not error, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {type(error).__name__}")
    assert "Traceback" not in result.output
    debug = CliRunner().invoke(main, ["--debug", "ls", str(tmp_path)])
    assert debug.exception is error


def test_a_link_at_the_weights_only_directory_is_never_written_through(tmp_path):
    from persist_core.config import Config
    from persist_core.session import PersistSession

    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "weights-only").symlink_to(target)
    session = PersistSession(Config(local_dir=tmp_path / "ckpt"), resume_hint="resume")
    with pytest.raises(ConfigError, match="weights-only is a symbolic link"):
        session.save({"w": torch.ones(2)}, 1, kind="weights-only")
    session.close()
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("given", [None, "run-given"], ids=["read", "written"])
def test_a_run_id_that_is_a_directory_is_a_config_error_naming_it(tmp_path, no_launcher_run_id, given):
    root = tmp_path / "ckpt"
    (root / RUN_ID_NAME).mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"{RUN_ID_NAME} is not a regular file.*remove it"):
        if given is None:  # the lease reads the run id kept there
            CheckpointEngine(root, remote_url=memory_url())
        else:  # the memory tier keeps the given one there
            CheckpointEngine(root, run_id=given, memory=MemoryTier(memory_dir=tmp_path / "shm"))
    assert (root / RUN_ID_NAME).is_dir() and not (root / f"{RUN_ID_NAME}.tmp").exists()  # left as it was
