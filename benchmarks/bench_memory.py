"""The memory tier (issue 42), one node: what a per-step snapshot costs training, how many steps a SIGKILL loses,
and how long a restart takes to load, from memory, from the local disk and from a remote — each beside today's
disk-only continuous saving and the floors measured in the same run.

1. **C per step** (the accelerator-like setting: a 4 x Linear(``--width``) model with SGD momentum; each step waits
   ``--step-ms`` of "device time" with the host free, then updates in place): ``maybe_save`` with
   ``MemoryTier(every_n_steps=1)`` and no disk policy, the time it blocks the loop per step (median), against the
   floor: a raw copy of the same tensors into one mapped buffer of the same size in the same tmpfs, on the same
   thread, right after the same update. Also behind ``engine.guard(opt)``: what ``maybe_save`` blocks plus what the
   next update waits for the snapshot's deferred copy.
2. **Kill trials**: a job (the same model) resumes from the freshest source and trains until SIGKILLed at a random
   step (uniform in ``[--kill-min, --kill-max]`` steps after its start); the next trial restarts it on the same
   machine. Per trial: steps lost = the last step the job finished - the step the restart resumed from. Memory
   tier (snapshots every step, disk ``Continuous()``) against disk only (``Continuous()``, guarded, as the goodput
   benchmark runs it). Bar: <= 1 step lost in >= 99% of trials with the memory tier.
3. **Restart loads**: ``CheckpointReader.load()`` of the state from memory, from the local disk (page cache
   dropped where the kernel lets us), and from a ``file://`` remote (a fresh local_dir), medians of ``--repeat``.

Usage: ``python benchmarks/bench_memory.py [--width 1536] [--step-ms 80] [--trials 20] [--disk-trials N] [--memory-dir /dev/shm/...]
[--dir bench-out]``; ``--smoke``: a tiny model and one trial (a check that it runs; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks._common import MB, accel_model, drop_cached, files_under, jobs, kills, nbytes, tensors  # noqa: E402
from benchmarks._common import training_state  # noqa: E402
from benchmarks._common.tables import print_table  # noqa: E402
from persist_core import CheckpointEngine, CheckpointReader, MemoryTier  # noqa: E402


def kill_series(kind: str, base: Path, memory_root: Path, args: argparse.Namespace,
                rng: random.Random) -> list[int]:
    """``args.trials`` kills in a row on one machine (``--disk-trials`` for the disk-only baseline) of the job
    (:mod:`benchmarks._common.jobs`: the memory tier every step and disk ``Continuous()``, unguarded; or disk
    ``Continuous()`` alone, guarded, as the goodput benchmark runs it), by :func:`benchmarks._common.kills.
    kill_series`; the steps each lost."""
    trials = args.disk_trials if kind == "disk" and args.disk_trials is not None else args.trials
    local_dir = base / f"kill-{kind}"
    memory_dir = memory_root / f"kill-{kind}" if kind == "memory" else None
    shutil.rmtree(local_dir, ignore_errors=True)
    command = jobs.command(local_dir, "Memory(1)+Continuous()" if memory_dir else "Continuous()", width=args.width,
                           setting="accel", step_ms=args.step_ms, guard=memory_dir is None, memory_dir=memory_dir)
    series = kills.kill_series([command], trials, lambda: rng.randint(args.kill_min, args.kill_max))
    lost = [k.lost for k in series]
    loads = [k.restart.starts[0]["load_s"] for k in series]
    shutil.rmtree(local_dir, ignore_errors=True)
    if memory_dir is not None:
        shutil.rmtree(memory_dir, ignore_errors=True)
    print(f"  {kind}: steps lost per kill {lost}; start to first step (median) {statistics.median(loads):.2f} s",
          flush=True)
    return lost


def c_per_step(memory_root: Path, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """``(snapshot's blocking time per step, the floor's, the step, a guarded snapshot's cost per step)``, medians,
    in seconds."""
    model, opt = accel_model(args.width, stepped=True)
    state = training_state(model, opt, step=0)
    size = nbytes(state)
    srcs = tensors(state)
    # the floor: a raw copy of the same bytes into one mapped buffer of the same tmpfs, the same thread, same moment
    floor_dir = Path(tempfile.mkdtemp(dir=memory_root))
    fd = os.open(floor_dir / "floor", os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, size)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    floor, snap = [], []
    with CheckpointEngine(Path(floor_dir) / "ckpt", memory=MemoryTier(memory_dir=memory_root / "c"),
                          preemption=None) as engine:
        for step in range(1, args.steps + 1):
            time.sleep(args.step_ms / 1000)
            opt.step()
            t0 = time.perf_counter()
            at = base
            for t in srcs:
                n = t.numel() * t.element_size()
                ctypes.memmove(at, t.data_ptr(), n)
                at += n
            t1 = time.perf_counter()
            time.sleep(args.step_ms / 1000)
            opt.step()
            t2 = time.perf_counter()
            engine.maybe_save(lambda: training_state(model, opt, step=step), step)
            t3 = time.perf_counter()
            floor.append(t1 - t0)
            snap.append(t3 - t2)
    guarded = []  # the same loop behind engine.guard(opt): what maybe_save blocks, plus the next update's wait
    with CheckpointEngine(Path(floor_dir) / "guarded", memory=MemoryTier(memory_dir=memory_root / "g"),
                          preemption=None) as engine:
        engine.guard(opt)
        for step in range(1, args.steps + 1):
            time.sleep(args.step_ms / 1000)  # the device time: the deferred copy of the last snapshot runs now
            t0 = time.perf_counter()
            engine.fence()  # what the update's pre-hook would wait for (it then finds nothing pending)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            engine.maybe_save(lambda: training_state(model, opt, step=step), step)
            guarded.append(t1 - t0 + time.perf_counter() - t2)
    del base
    mapping.close()
    shutil.rmtree(floor_dir, ignore_errors=True)
    warm = max(1, args.steps // 5)  # the first snapshots also map and fault in their slots
    return (statistics.median(snap[warm:]), statistics.median(floor[warm:]), args.step_ms / 1000,
            statistics.median(guarded[warm:]))


def restart_loads(base: Path, memory_root: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of a load of the same state from memory, the local disk and a ``file://`` remote."""
    model, opt = accel_model(args.width, stepped=True)
    local, remote = base / "loads", base / "loads-remote"
    shutil.rmtree(local, ignore_errors=True)
    shutil.rmtree(remote, ignore_errors=True)
    memory = MemoryTier(memory_dir=memory_root / "loads")
    engine = CheckpointEngine(local, memory=memory, remote_url=f"file://{remote}", preemption=None)
    engine.save(training_state(model, opt, step=1), 1)
    engine.wait()
    engine.close(keep_memory=True)
    times: dict[str, list[float]] = {"memory": [], "local disk": [], "remote (file://)": []}
    for _ in range(args.repeat):
        with CheckpointReader(local, memory=memory) as reader:
            t0 = time.perf_counter()
            reader.load()
            times["memory"].append(time.perf_counter() - t0)
        drop_cached(files_under(local))
        with CheckpointReader(local) as reader:
            t0 = time.perf_counter()
            reader.load()
            times["local disk"].append(time.perf_counter() - t0)
        fresh = base / "loads-fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        with CheckpointReader(fresh, remote_url=f"file://{remote}") as reader:
            t0 = time.perf_counter()
            reader.load()
            times["remote (file://)"].append(time.perf_counter() - t0)
        shutil.rmtree(fresh, ignore_errors=True)
    shutil.rmtree(memory_root / "loads", ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--step-ms", type=float, default=80.0)
    parser.add_argument("--steps", type=int, default=30, help="steps of the C-per-step measurement")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--disk-trials", type=int, default=None, help="the disk-only baseline's kills (default --trials)")
    parser.add_argument("--kill-min", type=int, default=3)
    parser.add_argument("--kill-max", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory-dir", default=None, help="a tmpfs (default /dev/shm/torch-persist-bench)")
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.step_ms, args.steps, args.trials, args.kill_min, args.kill_max, args.repeat = \
            64, 5.0, 6, 1, 2, 4, 1
    base = Path(args.dir).absolute() / "memory"
    base.mkdir(parents=True, exist_ok=True)
    memory_root = kills.tmpfs_dir(args.memory_dir, "torch-persist-bench", base / "shm")
    model, opt = accel_model(args.width)
    size = nbytes(training_state(model, opt, step=0))
    print(f"state {size / MB:.0f} MB (4 x Linear({args.width}) + SGD momentum), step {args.step_ms:.0f} ms of device "
          f"time, memory tier in {memory_root}", flush=True)

    snap, floor, step, guarded = c_per_step(memory_root, args)
    print(f"C per step: snapshot {snap * 1e3:.1f} ms, floor (raw copy into a mapped buffer) {floor * 1e3:.1f} ms: "
          f"{snap / floor:.2f}x the floor; {snap / step:.1%} of a {step * 1e3:.0f} ms step", flush=True)
    print(f"C per step, guarded (engine.guard(opt): maybe_save's block + the next update's wait for the copy): "
          f"{guarded * 1e3:.1f} ms, {guarded / floor:.2f}x the floor; {guarded / step:.1%} of the step", flush=True)

    rng = random.Random(0)
    print(f"kill trials ({args.trials} with the memory tier, {args.disk_trials or args.trials} disk only, killed {args.kill_min}-{args.kill_max} steps after each start):", flush=True)
    lost = {kind: kill_series(kind, base, memory_root, args, rng) for kind in ("memory", "disk")}

    loads = restart_loads(base, memory_root, args)
    labels = {"memory": "memory tier (every step) + disk Continuous()", "disk": "disk only, Continuous()"}
    print_table(["", "steps lost per kill: P50", "max", "<= 1 step lost"],
                [[labels[kind], f"{statistics.median(v):.0f}", max(v), f"{sum(x <= 1 for x in v) / len(v):.0%} of {len(v)}"]
                 for kind, v in lost.items()])
    print_table(["load of the state from", "seconds"], [[where, f"{seconds:.3f}"] for where, seconds in loads.items()])
    print(f"\nC per step {snap / floor:.2f}x the floor (bar <= 1.25x), guarded {guarded / floor:.2f}x; memory tier: "
          f"{sum(v <= 1 for v in lost['memory'])} of {len(lost['memory'])} kills lost <= 1 step (bar >= 99%)")
    shutil.rmtree(memory_root / "c", ignore_errors=True)
    shutil.rmtree(memory_root / "g", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
