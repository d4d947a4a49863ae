"""SIGKILL mid-save: the newest listed checkpoint is intact and equals what was saved for its step."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from persist_core import CheckpointEngine, KeepLastN
from tests.support.states import assert_state_equal
from tests.support.crash_child import incremental_state_for, state_for

ROOT = Path(__file__).resolve().parents[2]


def run_until_killed(local_dir: Path, first_step: int, lines_before_kill: int, *mode: str) -> int:
    """Start the child (``mode``: its extra arguments), SIGKILL it right after its ``lines_before_kill``-th save
    returned."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.crash_child", str(local_dir), str(first_step), *mode],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        last = None
        for _ in range(lines_before_kill):
            line = child.stdout.readline()
            assert line.startswith("saved "), f"child died early: {line!r}"
            last = int(line.split()[1])
        child.send_signal(signal.SIGKILL)  # somewhere in the next save, or in this one's write
    finally:
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return last


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_mid_save_leaves_newest_checkpoint_intact(tmp_path, trial):
    rng = random.Random(trial)
    local_dir = tmp_path / "ckpt"
    first = 1
    for _round in range(2):  # kill, then resume on the same directory and kill again
        last_returned = run_until_killed(local_dir, first, rng.randint(3, 8))
        engine = CheckpointEngine(local_dir)
        assert not [p for p in local_dir.iterdir() if p.name.startswith(".tmp-")], "stale temporary dir survived"
        steps = [i.step for i in engine.list()]
        # save(k) returns only after write(k-1) freed the one buffer (its manifest may still be
        # pending), and the writer commits in order, so k-2 is committed
        assert steps and steps[-1] >= last_returned - 2, (steps, last_returned)
        newest = engine.load()
        assert_state_equal(newest, state_for(steps[-1]))
        for s in steps:
            assert engine.load(s)["step"] == s
        engine.close()
        first = steps[-1] + 1


@pytest.mark.parametrize("trial", range(1))
def test_sigkill_mid_incremental_save_leaves_every_listed_checkpoint_whole_references_and_all(tmp_path, trial):
    """Killed while incremental saves are written and retention removes checkpoints that others referenced: every
    listed checkpoint loads (its references resolve) and equals what was saved for its step; a restart goes on."""
    rng = random.Random(100 + trial)
    local_dir = tmp_path / "ckpt"
    first = 1
    for _round in range(3):
        run_until_killed(local_dir, first, rng.randint(4, 9), "incremental")
        engine = CheckpointEngine(local_dir)
        steps = [i.step for i in engine.list()]
        assert steps, "nothing committed"
        for s in steps:
            assert_state_equal(engine.load(s), incremental_state_for(s))
        engine.close()
        first = steps[-1] + 1


def test_sigkill_during_uploads_of_incremental_saves_then_a_fresh_machine_restores_bit_exact(tmp_path, bucket,
                                                                                            s3_endpoint):
    """Killed while incremental saves are written and uploaded to S3 (the moto server, through s3fs), remote retention
    removing checkpoints others referenced: every checkpoint the remote lists loads bit-exact on a fresh machine (its
    references resolve there), and a restart on the same directory uploads what was left, after which a fresh machine
    resumes from the newest."""
    from persist_core import CheckpointReader

    rng = random.Random(200)
    url, local_dir = f"s3://{bucket}/run", tmp_path / "ckpt"
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    first = 1
    for round_ in range(2):
        run_until_killed(local_dir, first, rng.randint(3, 7), "incremental-remote", url, s3_endpoint)
        with CheckpointReader(tmp_path / f"fresh-{round_}", remote_url=url, storage_options=options) as fresh:
            listed = [c.step for c in fresh.list("remote")]
            for s in listed:  # whatever the kill left on the remote: whole, references and all
                assert_state_equal(fresh.load(s), incremental_state_for(s))
                assert fresh.loaded_from_remote
        with CheckpointEngine(local_dir, remote_url=url, storage_options=options, incremental=True,
                              keep_remote=KeepLastN(2)) as engine:  # a restart: uploads what the kill left
            engine.wait()
            newest = engine.list()[-1].step
            assert engine.list(tier="remote")[-1].step == newest
        with CheckpointReader(tmp_path / f"resumed-{round_}", remote_url=url, storage_options=options) as fresh:
            assert_state_equal(fresh.load(), incremental_state_for(newest))
            assert fresh.loaded_step == newest
        first = newest + 1
