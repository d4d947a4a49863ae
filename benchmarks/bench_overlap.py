"""Overlapped snapshots: the stall of save() with engine.guard(optimizer) against without, on a real CPU step.

A model of Linear(2048) layers + Adam (about 0.6 GB of state) on this machine's CPU; per save: the
time save() blocks, the next training step (forward, backward, Adam) right after it, and how long
that step's optimizer.step() waited for the background copy (the fence). Baselines measured in the
same run: the same step with no save in flight, and the copy floor (a plain copy_ of the state into
preallocated memory). Medians of --repeat saves after a warm-up.

Second part (``--accel-rounds``, 0 to skip): the accelerator-like step of the goodput benchmark (the host
waits --step-ms of "device time", then an in-place SGD-with-momentum update of 4 x Linear(3072) runs on
the host cores) under continuous guarded saving, in blocks of --block steps interleaved in one process:
no saves (the baseline), saving with the writes yielding to the update (overlap.Turn, the default), and
saving with that switched off (the behaviour before it). Per block the mean step and update times; C (what
saving adds per save) = (step with saves - step without) x steps / saves; medians over the rounds.

    .venv/bin/python benchmarks/bench_overlap.py [--layers 12] [--repeat 5] [--accel-rounds 6]
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
    parser.add_argument("--accel-rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=12)
    parser.add_argument("--step-ms", type=float, default=80.0)
    args = parser.parse_args()
    cpu_step(args)
    if args.accel_rounds:
        accel(args)


def accel(args: argparse.Namespace) -> None:
    from persist_core import Continuous, KeepLastN

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # fixed gradients: the device's backward, done
    opt.step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    kinds = ("no saves", "saving, writes yield", "saving, no yield")
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as work:
        engines = {k: CheckpointEngine(Path(work) / str(i), save_policy=Continuous(), keep_local=KeepLastN(1))
                   for i, k in enumerate(kinds)}
        engines["saving, no yield"]._overlap.turn.hold = lambda: None  # the writes run through the updates
        step_no = 0
        for _ in range(args.accel_rounds):
            for kind in kinds:
                engine = engines[kind]
                guard = engine.guard(opt)
                saves0, t_update, t0 = engine._overlap.runs, 0.0, time.perf_counter()
                for _ in range(args.block):
                    step_no += 1
                    time.sleep(args.step_ms / 1000)  # the device computes; the host's cores are free
                    u0 = time.perf_counter()
                    opt.step()
                    t_update += time.perf_counter() - u0
                    if kind != "no saves":
                        engine.maybe_save(state, step=step_no)
                took = time.perf_counter() - t0
                engine.wait()  # nothing of this block's saves runs into the next block
                guard.remove()
                results[kind].append((took / args.block, t_update / args.block, engine._overlap.runs - saves0))
        for engine in engines.values():
            engine.close()
    med = statistics.median
    bare = med(r[0] for r in results["no saves"])
    print(f"\naccelerator-like step ({args.step_ms:g} ms device time + the in-place update of 4 x Linear(3072), "
          f"0.30 GB with momentum), saving continuously, blocks of {args.block} steps x {args.accel_rounds} rounds")
    print(f"{'':>22} {'step':>8} {'update':>8} {'saves/block':>12} {'C per save':>11}")
    cost = {}
    for kind in kinds:
        step, update = med(r[0] for r in results[kind]), med(r[1] for r in results[kind])
        saves = med(r[2] for r in results[kind])
        per = [(r[0] - b[0]) * args.block / r[2] for r, b in zip(results[kind], results["no saves"]) if r[2]]
        cost[kind] = med(per) if per else None
        print(f"{kind:>22} {step * 1e3:>6.1f}ms {update * 1e3:>6.1f}ms {saves:>12.1f} "
              + (f"{cost[kind] * 1e3:>9.1f}ms" if cost[kind] is not None else f"{'-':>11}"))
    if cost["saving, writes yield"] is not None and cost["saving, no yield"]:
        print(f"C with the writes yielding / without: {cost['saving, writes yield'] / cost['saving, no yield']:.2f}x "
              f"(a step with no saves {bare * 1e3:.1f} ms)")


def cpu_step(args: argparse.Namespace) -> None:
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
        with tempfile.TemporaryDirectory(prefix="bench-overlap-") as work, CheckpointEngine(work) as engine:
            guard = engine.guard(opt) if guarded else None
            stalls, steps, fences = [], [], []
            for i in range(args.repeat + 1):
                t0 = time.perf_counter()
                handle = engine.save(state(), step=i)
                stall = time.perf_counter() - t0
                took = step()
                if i:
                    stalls.append(stall)
                    steps.append(took)
                    fences.append(handle.stats.fence_s)  # what this step's update waited for the save's copy
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
