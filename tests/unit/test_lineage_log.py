"""A run's lineage (issue 55 item 4): ``persist log`` / ``persist ls --lineage`` show a run as its tree of resumes and
branches; memory snapshots record lineage; a resume on another world size says which per-rank state it could not
restore, never as a mismatch."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, PerRank, ResumeMismatchWarning
from persist_core.cli.app import main
from persist_core.format.manifest import Manifest
from persist_core.lineage import run_tree, tree_lines
from persist_core.load.verify import verify_resume

ROOT = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(4, 3), "step": seed}


def _run_with_a_resume_and_a_branch(root: Path) -> None:
    """A fresh start saves 1, 2, 3; a resume from 3 saves 4, 5; a resume that goes back to 2 saves 3 again (the
    old 3, 4, 5 set aside) and 4."""
    with CheckpointEngine(root, direct_io="off", run_id="run-a") as engine:
        for step in (1, 2, 3):
            engine.save(_state(step), step).wait()
    with CheckpointEngine(root, direct_io="off", run_id="run-a") as engine:
        engine.load()
        for step in (4, 5):
            engine.save(_state(step), step).wait()
    with CheckpointEngine(root, direct_io="off", run_id="run-a") as engine:
        engine.load(step=2)
        for step in (3, 4):
            engine.save(_state(step + 10), step).wait()


def test_persist_log_shows_the_run_as_its_tree_of_resumes_and_branches(tmp_path):
    _run_with_a_resume_and_a_branch(tmp_path)
    done = CliRunner().invoke(main, ["log", str(tmp_path)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0] == f"{tmp_path}: 7 checkpoint(s), 1 root(s)"
    assert lines[1] == "steps 1..3 (3 checkpoints): fresh start [run run-a]; set aside: 3"
    assert lines[2] == "├─ steps 4..5 (2 checkpoints): resumed from step 3 [run run-a]; set aside: 4, 5"
    assert lines[3] == "└─ steps 3..4 (2 checkpoints): resumed from step 2, a branch (went back to step 2) [run run-a]"
    assert len(lines) == 4
    same = CliRunner().invoke(main, ["ls", "--lineage", str(tmp_path)], catch_exceptions=False)
    assert same.output == done.output
    tree = json.loads(CliRunner().invoke(main, ["log", "--json", str(tmp_path)], catch_exceptions=False).output)
    assert [r["steps"] for r in tree] == [[1, 2, 3]]
    assert [(c["steps"], c["resumed_from"], c["branch_from"]) for c in tree[0]["children"]] == [
        ([4, 5], {"step": 3, "run": "run-a"}, None), ([3, 4], {"step": 2, "run": "run-a"}, 2)]


def test_a_resume_that_saves_its_step_again_hangs_below_the_step_before():
    fresh = {"run": "r", "resumed_from": None, "branch_from": None}
    again = {"run": "r", "resumed_from": {"step": 2, "run": "r"}, "branch_from": None}
    roots = run_tree([(1, 1.0, fresh, False), (2, 2.0, again, False), (3, 3.0, again, False), (0, 0.5, None, False)])
    assert tree_lines(roots) == ["step 0: no lineage recorded (format version before 7)",
                                 "step 1: fresh start [run r]",
                                 "└─ steps 2..3 (2 checkpoints): resumed from step 2 [run r]"]


@pytest.mark.slow
def test_persist_log_as_a_user_runs_it(tmp_path):
    _run_with_a_resume_and_a_branch(tmp_path)
    done = subprocess.run([sys.executable, "-m", "persist_core.cli", "log", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert "└─ steps 3..4 (2 checkpoints): resumed from step 2, a branch (went back to step 2)" in done.stdout
    empty = subprocess.run([sys.executable, "-m", "persist_core.cli", "log", str(tmp_path / "x")],
                           capture_output=True, text=True, cwd=ROOT, check=False)
    assert empty.returncode != 0 and "is not a directory" in empty.stderr


def test_a_memory_snapshot_records_the_runs_lineage(tmp_path):
    from persist_core.memory import MemoryTier

    memory = MemoryTier(every_n_steps=1, memory_dir=tmp_path / "shm")
    with CheckpointEngine(tmp_path / "ckpt", direct_io="off", run_id="run-m") as engine:
        engine.save(_state(1), 1).wait()
    engine = CheckpointEngine(tmp_path / "ckpt", direct_io="off", run_id="run-m", memory=memory)
    try:
        engine.load()
        engine.snapshot(_state(2), 2)
        engine.wait_snapshot()
        manifest = engine._parts.snapshots.store.read_manifest(2)
    finally:
        engine.close()
    assert manifest.lineage is not None and manifest.lineage["run"] == "run-m"
    assert manifest.lineage["resumed_from"] == {"step": 1, "run": "run-m"}


# ---------------------------------------------------------------- another world size


def _per_rank_manifest(tmp_path: Path) -> tuple[Manifest, dict]:
    with CheckpointEngine(tmp_path, direct_io="off") as engine:
        engine.save({"w": torch.ones(3), "rng": PerRank(torch.get_rng_state()), "pos": PerRank(7)}, 3).wait()
    m = Manifest.from_bytes((tmp_path / "step-000000000003" / "manifest.json").read_bytes(), where="3")
    return m, {"w": torch.ones(3), "rng": torch.get_rng_state(), "pos": 7}


def _verify(m: Manifest, state: dict, *, rank: int, world_size: int, caplog) -> tuple[list[str], list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="persist_core.load.verify"), warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatchWarning)
        keys = verify_resume(m, state, mode="warn", ignore=(), rank=rank, world_size=world_size)
    return keys, [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_resume_on_more_ranks_says_which_per_rank_state_this_rank_did_not_get(tmp_path, caplog):
    m, state = _per_rank_manifest(tmp_path)
    keys, said = _verify(m, state, rank=1, world_size=2, caplog=caplog)
    assert keys == []  # never a mismatch
    assert any("not verified (resharded): rng, pos" in s for s in said)
    lost = [s for s in said if "per-rank state not restored" in s]
    assert len(lost) == 1 and "(rng, pos)" in lost[0] and "this rank got None" in lost[0]
    assert "resumed on 2 rank(s) from a checkpoint 1 rank(s) wrote" in lost[0]
    keys, said = _verify(m, state, rank=0, world_size=2, caplog=caplog)  # rank 0 got its own: nothing lost there
    assert keys == [] and not any("per-rank state not restored" in s for s in said)


def test_a_resume_on_fewer_ranks_says_whose_per_rank_state_is_restored_on_no_rank(tmp_path, caplog):
    m, state = _per_rank_manifest(tmp_path)
    four = dataclasses.replace(m, world_size=4, lineage={**(m.lineage or {}), "world_size": 4})
    keys, said = _verify(four, state, rank=0, world_size=2, caplog=caplog)
    lost = [s for s in said if "per-rank state not restored" in s]
    assert keys == [] and len(lost) == 1 and "the values of ranks 2..3 are restored on no rank" in lost[0]
    keys, said = _verify(m, state, rank=0, world_size=1, caplog=caplog)  # the same world size: all compared
    assert keys == [] and not any("not restored" in s for s in said)
