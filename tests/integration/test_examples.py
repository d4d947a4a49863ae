"""The README's minimal examples run as a user runs them: each in a fresh interpreter, within 30 s.

``examples/{engine,lightning,accelerate}_min.py`` are the code a user copies; this runs each from the repository
root with the worktree's packages first on ``PYTHONPATH`` and checks it exits 0 and prints its resume.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 30


@pytest.mark.parametrize("name, needs, resumed", [
    ("engine_min.py", None, "machine 2 (an empty local_dir) resumed at step 30"),
    ("lightning_min.py", "lightning", "/remote/step-000000000020"),
    ("accelerate_min.py", "accelerate", "machine 2 (an empty local_dir) resumed at step 20"),
])
def test_minimal_example_runs(name: str, needs: str | None, resumed: str) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=LIMIT_S)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    second = [line for line in done.stdout.splitlines() if line.startswith("machine 2")]
    assert len(second) == 1 and resumed in second[0], done.stdout[-3000:]  # resumed from machine 1's remote
