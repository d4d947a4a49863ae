"""SIGKILL a Lightning run that checkpoints every step, at a random moment, and check what is left.

Each trial starts ``tests/support/lightning_app.py`` (``ModelCheckpoint(every_n_train_steps=1,
save_top_k=2, save_last=True)`` through ``PersistCheckpointIO``) with a model wide enough that a
commit lands after the next save was requested, kills it with SIGKILL once ``last.ckpt`` first
exists plus a random delay, then checks: ``last.ckpt`` exists, is a committed checkpoint, loads
(verified) and with ``torch.load``, and a new run resumes from it (``fit(ckpt_path=last)``) to the end.

Usage: ``python benchmarks/lightning_kill_trials.py [--trials 10] [--width 1536] [--dir bench-out]``; ``--smoke``:
one trial of a narrow model (CI runs it).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common.kills import kill_when_ready  # noqa: E402

APP = ROOT / "tests" / "support" / "lightning_app.py"


def trial(d: Path, width: int, delay_s: float) -> str | None:
    """One kill and its checks; ``None`` when all hold, else what failed."""
    import torch

    from lightning_persist import PersistCheckpointIO
    from persist_core import CheckpointReader

    shutil.rmtree(d, ignore_errors=True)
    problem = kill_when_ready([sys.executable, str(APP), "--local-dir", str(d), "--max-steps", "500", "--width",
                               str(width)], lambda: os.path.lexists(d / "last.ckpt"), delay_s, cwd=Path.cwd())
    if problem is not None:
        return f"{problem}: it never linked last.ckpt"
    last = d / "last.ckpt"
    if not os.path.lexists(last):
        return "last.ckpt is missing after the kill"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = PersistCheckpointIO(local_dir=d).load_checkpoint(last)
            plain = torch.load(last, weights_only=False)
    except Exception as e:  # the trial's finding, whatever it is
        return f"last.ckpt does not load: {type(e).__name__}: {e}"
    if plain["global_step"] != ours["global_step"]:
        return "torch.load and the plugin disagree"
    newest = CheckpointReader(d).latest()
    if newest is None or newest.step < ours["global_step"]:
        return "last.ckpt names a step newer than the newest committed"
    resumed = subprocess.run([sys.executable, str(APP), "--local-dir", str(d), "--max-steps",
                              str(ours["global_step"] + 2), "--width", str(width), "--resume"],
                             capture_output=True, text=True, timeout=300)
    if resumed.returncode != 0:
        return f"resuming failed: {resumed.stderr[-500:]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true", help="one trial, a narrow model: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.trials, args.width = 1, 256
    rng = random.Random(args.seed)
    d = Path(args.dir).absolute() / "kill-trials"
    failures = []
    for i in range(args.trials):
        delay = rng.uniform(0.0, 0.5 if args.smoke else 3.0)
        problem = trial(d, args.width, delay)
        print(f"trial {i + 1}: kill {delay:.2f} s after last.ckpt first appeared: {problem or 'ok'}", flush=True)
        if problem:
            failures.append(problem)
    shutil.rmtree(d, ignore_errors=True)
    print(f"{args.trials - len(failures)} of {args.trials} trials left a last.ckpt that loads and resumes")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
