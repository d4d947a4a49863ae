"""One side of a paired A/B of two source trees (issue 54's bar: the regroup costs nothing on the hot paths).

Run with the tree under test first on ``PYTHONPATH``; prints one JSON line: the medians over ``--saves`` disk saves of
the stall (``save()`` blocking the caller) and of save -> committed, and the median visible time of a memory snapshot
per step (``engine.snapshot`` on the training thread), on a state of ``--mib`` MiB of fp32 tensors. Pair it against
another tree with ``benchmarks/ab_pairs.sh`` (interleaved runs; the ratio of the medians per pair).

Usage: ``PYTHONPATH=TREE python benchmarks/ab_tree.py [--mib 256] [--saves 6] [--snapshots 12] [--dir DIR]``;
``--smoke``: tiny sizes (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from persist_core import CheckpointEngine, MemoryTier


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--snapshots", type=int, default=12)
    p.add_argument("--dir", default=None)
    p.add_argument("--smoke", action="store_true", help="a 4 MiB state, 2 saves, 2 snapshots (CI; means nothing)")
    a = p.parse_args(argv)
    if a.smoke:
        a.mib, a.saves, a.snapshots = 4, 2, 2
    root = Path(a.dir or tempfile.mkdtemp(prefix="ab-tree-"))
    shutil.rmtree(root, ignore_errors=True)
    n = a.mib * (1 << 20) // 4 // 16
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(16)}, "step": 0}
    stalls, commits, snaps = [], [], []
    with CheckpointEngine(root / "disk") as engine:
        for step in range(1, a.saves + 1):
            state["step"] = step
            t0 = time.perf_counter()
            handle = engine.save(state, step)
            stalls.append(time.perf_counter() - t0)
            handle.wait()
            commits.append(handle.stats.commit_s)
    with CheckpointEngine(root / "mem", memory=MemoryTier(memory_dir=root / "shm")) as engine:
        for step in range(1, a.snapshots + 1):
            state["step"] = step
            t0 = time.perf_counter()
            engine.snapshot(state, step)
            snaps.append(time.perf_counter() - t0)
            engine.wait()  # the commit outside the timed part, as the next step's compute hides it
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"stall_s": statistics.median(stalls[1:]), "commit_s": statistics.median(commits[1:]),
                      "snapshot_s": statistics.median(snaps[1:])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
