"""``benchmarks/bench_gpu.py --smoke``: the GPU benchmark's whole path (every method, the floors, the snapshot
check, the restore) on the CPU with a small model, so that a lent GPU machine never finds it broken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

METHODS = [
    "torch-persist unguarded",
    "torch-persist guarded",
    "torch-persist guarded continuous",
    "Lightning AsyncCheckpointIO",
    "DCP async_save",
    "DCP async_save + DefaultStager",
    "torch.save",
]
RESTORES = ["torch-persist (verified)", "torch.load", "DCP load"]


def test_bench_gpu_smoke_runs_every_method_bit_exact(tmp_path):
    markdown = tmp_path / "bench_gpu.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--smoke", "--dir", str(tmp_path / "out"),
                          "--markdown", str(markdown)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in run.stdout.splitlines() if line.startswith("| ")}
    for name in METHODS:
        assert name in rows, (name, run.stdout)
        assert rows[name].rstrip().endswith("| bit-exact |"), rows[name]
    for name in RESTORES:
        assert name in rows, (name, run.stdout)
    assert markdown.read_text().strip() in run.stdout
    assert not (tmp_path / "out").exists()  # it cleans up after itself
