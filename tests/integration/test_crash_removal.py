"""SIGKILL part-way through removing checkpoints that incremental ones reference (issue 43): ``persist gc`` and
``persist rm`` are killed right after their k-th removal; every checkpoint still listed loads bit-exact.

The kill is placed, not timed: the CLI runs in a child process whose local tier's ``remove`` SIGKILLs the process
after its k-th call returned, so each trial stops between two removals, where a removal in the wrong order (a
referenced checkpoint before the one referencing it) leaves a listed checkpoint whose references are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from persist_core import CheckpointEngine
from tests.support.crash_child import incremental_state_for
from tests.support.states import assert_state_equal

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, sys
from persist_core.tiers import local
from persist_core.cli import main
after = int(os.environ["KILL_AFTER_REMOVALS"])
done = []
original = local.LocalTier.remove
def remove(self, step):
    original(self, step)
    done.append(step)
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)
local.LocalTier.remove = remove
sys.argv = ["persist", *sys.argv[1:]]
main()
"""


def _saved(local_dir: Path, steps: range) -> None:
    """Incremental saves of a state with a frozen base: a full checkpoint every third (1, 4, 7, ...), the others
    referencing the last full one's base."""
    with CheckpointEngine(local_dir, incremental=True, full_every=3) as engine:
        for step in steps:
            engine.save(incremental_state_for(step), step).wait()
    with CheckpointEngine(local_dir) as engine:
        assert [c.step for c in engine.list()] == list(steps)


def _killed(args: list[str], after: int) -> None:
    child = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "KILL_AFTER_REMOVALS": str(after)})
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr


def _every_listed_loads(local_dir: Path) -> list[int]:
    with CheckpointEngine(local_dir) as engine:
        steps = [c.step for c in engine.list()]
        for s in steps:
            assert_state_equal(engine.load(s), incremental_state_for(s))
    return steps


@pytest.mark.parametrize("after", [1, 2, 4])
def test_gc_killed_between_removals_leaves_every_listed_checkpoint_whole(tmp_path, after):
    local_dir = tmp_path / "ckpt"
    _saved(local_dir, range(1, 8))
    _killed(["gc", str(local_dir), "--keep-last", "1", "--no-verify"], after)
    left = _every_listed_loads(local_dir)
    assert len(left) == 7 - after and left[-1] == 7, left


def test_rm_of_a_whole_chain_killed_after_the_first_removal_leaves_every_listed_checkpoint_whole(tmp_path):
    local_dir = tmp_path / "ckpt"
    _saved(local_dir, range(1, 5))
    _killed(["rm", str(local_dir), "--step", "1", "--step", "2", "--step", "3"], 1)
    assert _every_listed_loads(local_dir) == [1, 2, 4]
