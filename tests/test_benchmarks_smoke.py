"""Every benchmark's ``--smoke``: its whole path with tiny sizes, so that a broken benchmark fails CI.

Each runs in this process (``main(argv)``: the imports it shares with the others — torch, Lightning, DCP,
transformers — are paid once, not per benchmark), the process-wide settings a benchmark changes put back after it
(intra-op threads, logging, ``sys.path``; ``os.environ`` by the conftest). The figures mean nothing at these sizes:
what is checked is that it runs to the end, exits 0 and prints its table. ``bench_gpu.py --smoke`` is also checked
as ``benchmarks/gpu_check.sh`` runs it (every method's checkpoint bit-exact, the restores, the markdown), and
``accelerate_fsdp2_check.py --smoke`` in a process of its own (it starts a process group).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: script -> (the module it needs beyond torch, or None; a line its report prints)
SMOKES = {
    "ab_tree": (None, '"stall_s": '),
    "bench_save": (None, "| torch-persist |"),
    "bench_accelerate": ("accelerate", "| save_state with PersistHook |"),
    "bench_overlap": ("crc32c", "C with the writes yielding / without"),
    "bench_pieces": (None, "<- fileio.YIELD_PIECE_BYTES"),
    "bench_cpu_guard": (None, "C guarded / not guarded"),
    "bench_plan": (None, "this checkout"),
    "bench_restart": (None, "first save's copy (s)"),
    "bench_lightning": ("lightning", "| persist |"),
    "bench_hf_trainer": ("transformers", "| PersistTrainerCallback |"),
    "bench_remote": ("moto", "| **torch-persist upload**"),
    "bench_sharded": (None, "resharded load into fresh FSDP2 targets"),
    "bench_goodput": (None, "| continuous |"),
    "bench_incremental": ("xxhash", "| incremental=True |"),
    "bench_memory": (None, "kills lost <= 1 step"),
    "bench_memory_adapters": ("lightning", "every kill lost <= 1 step"),
    "bench_partner": (None, "partner copy / floor"),
    "bench_node_loss": (None, "lost <= the steps since the last partner copy: 1 of 1"),
    "fault_sweep": ("moto", "OK: "),
    "lightning_kill_trials": ("lightning", "1 of 1 trials left a last.ckpt that loads and resumes"),
    "bench_resume_bugs": ("accelerate", "2 of 2 bugs named"),
}

GPU_METHODS = [
    "torch-persist unguarded",
    "torch-persist guarded",
    "torch-persist guarded continuous",
    "Lightning AsyncCheckpointIO",
    "DCP async_save",
    "DCP async_save + DefaultStager",
    "torch.save",
]
GPU_RESTORES = ["torch-persist (verified)", "torch.load", "DCP load"]


@pytest.fixture
def in_process(monkeypatch):
    """Runs a benchmark's ``main(argv)`` here; puts back what benchmarks change for the whole process."""
    threads, path = torch.get_num_threads(), list(sys.path)
    levels = {name: logging.getLogger(name).level for name in ("persist_core", "lightning", "accelerate")}
    monkeypatch.chdir(ROOT)

    def run(script: str, *argv: str) -> int:
        module = importlib.import_module(f"benchmarks.{script}")
        try:
            return module.main(["--smoke", *argv])
        except SystemExit as e:  # a benchmark that gives up says why in its exit
            return e.code if isinstance(e.code, int) else f"exit: {e.code}"

    yield run
    torch.set_num_threads(threads)
    sys.path[:] = path
    logging.disable(logging.NOTSET)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_benchmark_smoke_runs(script, in_process, tmp_path, capsys):
    needs, printed = SMOKES[script]
    if needs is not None:
        pytest.importorskip(needs)
    options = {"bench_overlap": [], "bench_pieces": [], "bench_cpu_guard": [], "bench_plan": [],
               "bench_restart": [], "bench_remote": [], "fault_sweep": []}
    argv = options.get(script, ["--dir", str(tmp_path / "out")])
    status = in_process(script, *argv)
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    assert printed in out, out[-3000:]


def test_bench_gpu_smoke_runs_every_method_bit_exact(in_process, tmp_path, capsys):
    markdown = tmp_path / "bench_gpu.md"
    status = in_process("bench_gpu", "--dir", str(tmp_path / "out"), "--markdown", str(markdown))
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for name in GPU_METHODS:
        assert name in rows, (name, out)
        assert rows[name].rstrip().endswith("| bit-exact |"), rows[name]
    for name in GPU_RESTORES:
        assert name in rows, (name, out)
    assert markdown.read_text().strip() in out
    assert not (tmp_path / "out").exists()  # it cleans up after itself


def test_accelerate_fsdp2_check_smoke_restores_bit_exact():
    pytest.importorskip("accelerate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "benchmarks/accelerate_fsdp2_check.py", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # its own process: it starts a process group
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "accelerate FSDP2 model: bit-exact" in run.stdout and "accelerate FSDP2 optim: bit-exact" in run.stdout
