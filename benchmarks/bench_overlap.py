"""Overlapped snapshots: the stall of save() with engine.guard(optimizer) against without, on a real CPU step.

A model of Linear(2048) layers + Adam (about 0.6 GB of state) on this machine's CPU; per save: the
time save() blocks, the next training step (forward, backward, Adam) right after it, and how long
that step's optimizer.step() waited for the background copy (the fence). Baselines measured in the
same run: the same step with no save in flight, and the copy floor (a plain copy_ of the state into
preallocated memory). Medians of --repeat saves after a warm-up.

    .venv/bin/python benchmarks/bench_overlap.py [--layers 12] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from persist_core import CheckpointEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(args.layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, 2048)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    tensors = [t for t in model.state_dict().values()] + [v for s in opt.state.values() for v in s.values()
                                                           if isinstance(v, torch.Tensor)]
    dst = [torch.empty_like(t) for t in tensors]
    floors = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        floors.append(time.perf_counter() - t0)
    bare = statistics.median(step() for _ in range(args.repeat))
    rows = {}
    for guarded in (False, True):
        with CheckpointEngine(tempfile.mkdtemp(prefix="bench-overlap-")) as engine:
            guard = engine.guard(opt) if guarded else None
            stalls, steps, fences = [], [], []
            for i in range(args.repeat + 1):
                t0 = time.perf_counter()
                handle = engine.save(state(), step=i)
                stall = time.perf_counter() - t0
                before = engine._overlap.fence_s
                took = step()
                if i:
                    stalls.append(stall)
                    steps.append(took)
                    fences.append(engine._overlap.fence_s - before)
                handle.wait()
            nbytes = handle.stats.nbytes
            if guard is not None:
                guard.remove()
        rows[guarded] = (statistics.median(stalls), statistics.median(steps), statistics.median(fences))
    floor = statistics.median(floors)
    print(f"state {nbytes / 1e9:.2f} GB; copy floor {floor * 1e3:.0f} ms; a step with no save {bare * 1e3:.0f} ms")
    print(f"{'save':>10} {'stall':>9} {'/ floor':>8} {'next step':>10} {'/ bare step':>12} {'fence wait':>11}")
    for guarded, (stall, took, fence) in rows.items():
        print(f"{'guarded' if guarded else 'plain':>10} {stall * 1e3:>7.0f}ms {stall / floor:>7.2f}x {took * 1e3:>8.0f}ms "
              f"{took / bare:>11.2f}x {fence * 1e3:>9.0f}ms")
    print(f"stall with the guard / without: {rows[True][0] / rows[False][0]:.3f}x")


if __name__ == "__main__":
    main()
