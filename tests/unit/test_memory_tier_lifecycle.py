"""The memory tier's directories over their life (issue 53, items 3 to 5): the only copy of a step survives a clean
close of a process that only read it; the memory dir is this user's alone, never through a link; a snapshot belongs
to one incarnation of ``local_dir``.

Users' scenarios: an evaluation script that loads a killed run's newest snapshot and closes; a link or another
user's directory planted under ``/dev/shm``; a ``local_dir`` erased and made again under the same launcher run id."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointNotFoundError, CheckpointReader, EveryNSteps, MemoryTier
from tests.support.memory_child import state_for as child_state
from tests.support.states import assert_state_equal, state_for

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 12345


@pytest.fixture(autouse=True)
def _no_launcher_run_id(monkeypatch):
    for name in ("PERSIST_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def _memory(tmp_path: Path) -> MemoryTier:
    return MemoryTier(every_n_steps=1, memory_dir=tmp_path / "shm")


def _killed(tmp_path: Path, steps: range, *, disk_every: int | None = None, run_id: str = "run-x") -> None:
    """An engine on ``tmp_path/ckpt`` that snapshot ``steps`` and died (its slots stay, as a SIGKILL leaves them)."""
    engine = CheckpointEngine(tmp_path / "ckpt", run_id=run_id, memory=_memory(tmp_path),
                              save_policy=None if disk_every is None else EveryNSteps(disk_every))
    for step in steps:
        engine.maybe_save(lambda: state_for(step), step)
    engine.wait()
    engine._close(finished=False)


def _memory_steps(tmp_path: Path) -> set[int]:
    with CheckpointReader(tmp_path / "ckpt", memory=_memory(tmp_path)) as reader:
        return reader.memory_steps()


# ---- item 3: the only copy of a step is never deleted by a clean close


@pytest.mark.slow
def test_an_evaluation_that_loads_a_killed_runs_snapshot_and_closes_cleanly_leaves_it_for_the_restart(tmp_path):
    local_dir, memory_dir = tmp_path / "ckpt", tmp_path / "shm"
    child = subprocess.Popen([sys.executable, "-m", "tests.support.memory_child", str(local_dir), str(memory_dir), "4"],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().split() == ["resumed", "-1"]
        for expected in range(7):  # steps 0..6: the disk every 4th (once written), memory 5 and 6
            assert child.stdout.readline().split() == ["step", str(expected)]
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    memory = MemoryTier(memory_dir=memory_dir)
    with CheckpointEngine(local_dir, memory=memory) as evaluation:  # loads, evaluates, saves nothing, closes well
        state = evaluation.load()
        newest = state["step"]
        assert newest >= 5 and newest > max((c.step for c in evaluation.list()), default=-1)  # from memory
        assert_state_equal(state, child_state(newest))
    with CheckpointReader(local_dir, memory=memory) as restart:
        assert_state_equal(restart.load(), child_state(newest))  # still there: the only copy of that step


@pytest.mark.parametrize("disk_every, kept", [(4, True), (3, False)])
def test_a_clean_close_removes_a_killed_runs_snapshots_only_once_the_disk_holds_that_step(tmp_path, disk_every, kept):
    _killed(tmp_path, range(1, 7), disk_every=disk_every)  # memory up to 6; disk 4 (or 3 and 6)
    with CheckpointEngine(tmp_path / "ckpt", run_id="run-x", memory=_memory(tmp_path)) as evaluation:
        assert evaluation.load()["step"] == 6
    assert (6 in _memory_steps(tmp_path)) is kept


def test_a_clean_close_after_the_engines_own_snapshot_removes_every_snapshot(tmp_path):
    _killed(tmp_path, range(1, 4))
    with CheckpointEngine(tmp_path / "ckpt", run_id="run-x", memory=_memory(tmp_path)) as engine:
        assert engine.load()["step"] == 3
        engine.maybe_save(lambda: state_for(4), 4)
    assert _memory_steps(tmp_path) == set()
    assert not any((tmp_path / "shm").iterdir())


class _Killed(BaseException):
    """The process dies here."""


def test_a_kill_during_close_leaves_the_newest_snapshot_its_removal_goes_oldest_first(tmp_path, monkeypatch):
    unlink = os.unlink
    for survive in range(8):  # killed after the first ``survive`` files removed
        shutil.rmtree(tmp_path / "shm", ignore_errors=True)
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        engine = CheckpointEngine(tmp_path / "ckpt", run_id="run-x", memory=_memory(tmp_path))
        for step in range(1, 4):  # three slots: records of 1, 2, 3
            engine.maybe_save(lambda: state_for(step), step)
        engine.wait()
        before = _memory_steps(tmp_path)
        assert len(before) >= 2 and max(before) == 3
        calls = []

        def dying_unlink(path, *args, **kw):
            if len(calls) == survive:
                raise _Killed
            calls.append(path)
            return unlink(path, *args, **kw)

        monkeypatch.setattr(os, "unlink", dying_unlink)
        try:
            engine.close()
        except _Killed:
            pass
        finally:
            monkeypatch.setattr(os, "unlink", unlink)
        left = _memory_steps(tmp_path)
        assert not left or max(left) == 3, (survive, left)


# ---- item 4: the memory dir is this user's alone, never through a link


@pytest.mark.parametrize("level", ["run", "rank"])
def test_a_link_at_the_run_or_rank_directory_is_never_read_nor_removed_through(tmp_path, level, caplog):
    _killed(tmp_path, range(1, 4))  # what the link will point at: the run's snapshots, moved out of the memory dir
    elsewhere = tmp_path / "elsewhere"
    shutil.move(tmp_path / "shm" / "run-x", elsewhere)
    if level == "run":
        (tmp_path / "shm" / "run-x").symlink_to(elsewhere)
    else:
        (tmp_path / "shm" / "run-x").mkdir(mode=0o700)
        (tmp_path / "shm" / "run-x" / "rank-00000").symlink_to(elsewhere / "rank-00000")
    records = sorted(elsewhere.rglob("slot-*.json"))
    with caplog.at_level(logging.WARNING):
        with CheckpointEngine(tmp_path / "ckpt", run_id="run-x", memory=_memory(tmp_path)) as engine:
            with pytest.raises(CheckpointNotFoundError):
                engine.load()  # not what the link points at
            engine.maybe_save(lambda: state_for(1), 1)  # a restart's first snapshot (or disk only)
            engine.save(state_for(1), 1).wait()
    assert "symbolic link" in caplog.text
    assert "too little room" not in caplog.text  # not a matter of room: what is wrong was said, with its fix
    assert sorted(elsewhere.rglob("slot-*.json")) == records and len(records) >= 2  # never removed through it


@pytest.mark.parametrize("what, how", [("run", "chown"), ("rank", "chmod"), ("life", "chown"), ("life", "chmod"),
                                       ("record", "chown"), ("slot", "chmod")])
def test_another_users_or_a_world_writable_snapshot_is_not_read(tmp_path, what, how, caplog):
    _killed(tmp_path, range(1, 4), disk_every=2)  # memory 3, disk 2
    run = tmp_path / "shm" / "run-x"
    life = next(run.glob("rank-00000/life-*"))
    path = {"run": run, "rank": run / "rank-00000", "life": life, "record": next(life.glob("slot-*.json")),
            "slot": next(p for p in life.glob("slot-*") if p.suffix != ".json")}[what]
    if what in ("record", "slot"):  # every one of them
        for p in life.glob("slot-*" + (".json" if what == "record" else "")):
            if (p.suffix == ".json") == (what == "record"):
                os.chown(p, OTHER_UID, -1) if how == "chown" else os.chmod(p, 0o666)
    else:
        os.chown(path, OTHER_UID, -1) if how == "chown" else os.chmod(path, 0o777)
    with caplog.at_level(logging.WARNING), CheckpointReader(tmp_path / "ckpt", memory=_memory(tmp_path)) as reader:
        assert reader.load()["step"] == 2  # the disk's: the snapshot of 3 is not this user's own
        reader.load()
    named = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(run) in r.getMessage()]
    assert named and all("owned by" in m or "writable" in m for m in named), named
    assert len(named) == len(set(named)) == (1 if what in ("run", "rank", "life") else len(named))  # once a path


def test_the_memory_dirs_are_made_0700_and_their_files_0600(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt", run_id="run-x", memory=_memory(tmp_path)) as engine:
        engine.maybe_save(lambda: state_for(1), 1)
        engine.wait()
        run = tmp_path / "shm" / "run-x"
        dirs = [run, *(p for p in run.rglob("*") if p.is_dir())]
        files = [p for p in run.rglob("*") if p.is_file()]
        assert {oct(stat.S_IMODE(d.stat().st_mode)) for d in dirs} == {"0o700"}
        assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {"0o600"}
        assert any(f.name.endswith(".json") for f in files)


def test_the_default_memory_dir_is_per_user():
    base = MemoryTier().base
    assert base.name.endswith(str(os.geteuid()))
    if os.path.isdir("/dev/shm"):
        assert base == Path(f"/dev/shm/torch-persist-{os.geteuid()}")


# ---- item 5: a snapshot belongs to one incarnation of local_dir


def test_an_erased_and_remade_local_dir_never_resumes_the_old_snapshot_and_gc_removes_it(tmp_path, monkeypatch,
                                                                                          caplog):
    from persist_core.cli import main

    monkeypatch.setenv("PERSIST_RUN_ID", "job-77")  # the launcher's id: the same after the local_dir is remade
    _killed(tmp_path, range(1, 4), run_id=None)
    shutil.rmtree(tmp_path / "ckpt")  # rm -rf local_dir; the same job starts again
    with caplog.at_level(logging.INFO), CheckpointEngine(tmp_path / "ckpt", memory=_memory(tmp_path)) as engine:
        with pytest.raises(CheckpointNotFoundError):
            engine.load()
        engine.save(state_for(1), 1).wait()
        assert engine.load()["step"] == 1
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() and "life-" in r.getMessage()]
    assert len(skipped) == 1 and "erased" in skipped[0], skipped
    old = list((tmp_path / "shm").rglob("life-*"))
    assert len(old) == 1  # the killed run's, never resumed from
    shm = str(tmp_path / "shm")
    done = CliRunner().invoke(main, ["gc", str(tmp_path / "ckpt"), "--memory", "--memory-dir", shm, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["memory_removed"] == [str(old[0])]
    assert not list((tmp_path / "shm").rglob("life-*"))


def test_a_life_that_names_no_local_dir_identity_is_read_by_no_local_dir(tmp_path):
    _killed(tmp_path, range(1, 4), disk_every=2)
    for marker in (tmp_path / "shm").rglob("life-*/.identity"):
        marker.unlink()
    with CheckpointReader(tmp_path / "ckpt", memory=_memory(tmp_path)) as reader:
        assert reader.memory_steps() == set()
        assert reader.load()["step"] == 2


def test_partner_copies_belong_to_the_run_and_its_node_layout_not_to_a_local_dir(tmp_path):
    from persist_core.memory import MemoryStore

    _killed(tmp_path, range(5, 6), run_id="run-y")  # a snapshot of step 5, as rank 2 would send it
    snap = MemoryStore(tmp_path / "shm" / "run-y" / "rank-00000", identity=None).snapshots()[0]
    tier = _memory(tmp_path)
    held = tier.partner_store("run-x", 2, layout=((0, 1), (2, 3)))
    slot = held.open_life() / "slot-0"
    fd = os.open(slot, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, snap.path.read_bytes())
    os.close(fd)
    held.commit(slot, snap.manifest)
    held.close(remove=False)
    assert tier.partner_store("run-x", 2, layout=((0, 1), (2, 3))).steps() == {5}  # a restarted node, any local_dir
    assert tier.partner_store("run-x", 2, layout=((0, 1, 2, 3),)).steps() == set()  # another layout's: not read
