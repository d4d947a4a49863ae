"""Side-by-side save benchmark: torch-persist against the floor, the disk and the peers.

Every number is measured in this one run on the same state (default ~1 GiB of fp32 tensors)
and the same directory, and reported as a ratio to a baseline from this run:

* stall: how long the call blocks training, over the floor = a plain ``copy_`` of the same
  bytes into preallocated host memory (lower is better; the goal is <= 1.5x);
* throughput: bytes / (time from the call to durable on disk, fsync included), over the disk =
  parallel ``pwrite`` of the same bytes, buffered+fsync or O_DIRECT, whichever is faster
  (higher is better; the goal is >= 0.8x).

Peers: ``torch.save``, Lightning ``AsyncCheckpointIO``, ``torch.distributed.checkpoint``
(``save`` and ``async_save``) and ``Accelerator.save_state``. Peers that do not fsync are
fsynced after they finish, so every throughput is to durable storage. With CUDA, a GPU section
times the device-to-host staging from CUDA tensors into pinned buffers.

Usage: ``python benchmarks/bench_save.py [--gib 1.0] [--repeat 3] [--only cpu|gpu] [--dir bench-out]``;
``--smoke``: a 10 MiB state, one timed run each, in seconds (CI runs it; its ratios mean nothing).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import copy_floor, disk_gbps, floor_copy, fsync_tree, median, nbytes, table  # noqa: E402
from persist_core import CheckpointEngine  # noqa: E402


def make_state(gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A model-like state: a few large matrices and many small vectors, ~``gib`` GiB of fp32."""
    total = int(gib * (1 << 30)) // 4
    small = min(4096, total // 8192)
    sizes = [total // 8] * 6 + [total // 64] * 15
    sizes.append(total - sum(sizes) - 64 * small)
    sizes += [small] * 64
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g).to(device) for i, n in enumerate(sizes)}


# ------------------------------------------------------------------ contenders


def bench(name: str, run: Callable[[int, Path], tuple[float, float]], out: Path, repeat: int) -> tuple[float, float]:
    """``run(i, dir) -> (stall_s, durable_s)``; medians over ``repeat`` runs after one warm-up."""
    stalls, totals = [], []
    for i in range(repeat + 1):
        d = out / f"{name}-{i}"
        d.mkdir(parents=True)
        stall, total = run(i, d)
        if i:  # the first run allocates buffers and warms caches
            stalls.append(stall)
            totals.append(total)
        shutil.rmtree(d)
    return median(stalls), median(totals)


def run_persist(state):
    engines: dict[str, CheckpointEngine] = {}

    def run(i: int, d: Path) -> tuple[float, float]:
        if "e" not in engines:  # one engine (setdefault would open a second one on its locked directory)
            engines["e"] = CheckpointEngine(d.parent / "persist")
        engine = engines["e"]
        t0 = time.perf_counter()
        handle = engine.save(state, step=i)
        stall = time.perf_counter() - t0
        handle.wait()
        total = time.perf_counter() - t0
        for saved in engine.list():
            shutil.rmtree(saved.path)
        return stall, total

    return run, engines


def run_torch_save(state):
    def run(i: int, d: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        torch.save(state, d / "ckpt.pt")
        stall = time.perf_counter() - t0
        fsync_tree(d)
        return stall, time.perf_counter() - t0

    return run


def run_lightning_async(state):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    def run(i: int, d: Path) -> tuple[float, float]:
        io = AsyncCheckpointIO(TorchCheckpointIO())
        t0 = time.perf_counter()
        io.save_checkpoint({"state_dict": state}, d / "ckpt.ckpt")
        stall = time.perf_counter() - t0
        io.teardown()
        fsync_tree(d)
        return stall, time.perf_counter() - t0

    return run


def run_dcp(state, asynchronous: bool):
    import torch.distributed.checkpoint as dcp

    def run(i: int, d: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        if asynchronous:
            fut = dcp.async_save({"state": state}, checkpoint_id=str(d / "dcp"))
            stall = time.perf_counter() - t0
            fut.result()
        else:
            dcp.save({"state": state}, checkpoint_id=str(d / "dcp"))
            stall = time.perf_counter() - t0
        return stall, time.perf_counter() - t0  # FileSystemWriter fsyncs by default

    return run


def run_accelerate(state):
    from accelerate import Accelerator

    module = torch.nn.Module()
    for k, v in state.items():
        module.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v, requires_grad=False))
    accelerator = Accelerator(cpu=True)
    module = accelerator.prepare(module)

    def run(i: int, d: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        accelerator.save_state(str(d / "acc"))
        stall = time.perf_counter() - t0
        fsync_tree(d)
        return stall, time.perf_counter() - t0

    return run


def gpu_section(gib: float, repeat: int, out: Path) -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU section skipped: no CUDA device (run this script on a GPU machine for it)"]
    state = make_state(gib, "cuda")
    size = nbytes(state)
    floor = copy_floor(list(state.values()), repeat, to="cpu", pin=True, warmup=1)
    engine = CheckpointEngine(out / "gpu")
    stalls = []
    for i in range(repeat + 1):
        h = engine.save(state, step=i)
        h.wait()
        if i:
            stalls.append(h.stats.stall_s)
    loaded = engine.load(repeat, map_location="cuda")
    ok = all(torch.equal(loaded[k], v) for k, v in state.items())
    engine.close()
    return [
        f"GPU: {torch.cuda.get_device_name()}, {size / 1e9:.2f} GB of CUDA tensors",
        f"  floor (D2H copy_ into pinned, non_blocking): {floor * 1e3:.1f} ms = {size / floor / 1e9:.1f} GB/s",
        f"  torch-persist stall: {median(stalls) * 1e3:.1f} ms = {median(stalls) / floor:.2f}x floor; round trip equal: {ok}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--only", choices=["cpu", "gpu"], default=None)
    parser.add_argument("--smoke", action="store_true", help="a 10 MiB state, one timed run each: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.gib, args.repeat = 10 / 1024, 1
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP without a process group
    out = args.dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    lines = [f"torch {torch.__version__}, {os.cpu_count()} CPUs, directory {out}"]
    try:
        if args.only != "gpu":
            lines += cpu_section(args, out)
        if args.only != "cpu":
            lines += gpu_section(args.gib, args.repeat, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\n".join(lines))
    return 0


def cpu_section(args: argparse.Namespace, out: Path) -> list[str]:
    state = make_state(args.gib)
    size = nbytes(state)
    floor = floor_copy(state, args.repeat)
    disk = disk_gbps(size, out, args.repeat)
    best_disk = max(disk.values())
    persist, engines = run_persist(state)
    contenders: list[tuple[str, Callable]] = [
        ("torch-persist", persist),
        ("torch.save", run_torch_save(state)),
        ("Lightning AsyncCheckpointIO", run_lightning_async(state)),
        ("DCP save", run_dcp(state, asynchronous=False)),
        ("DCP async_save", run_dcp(state, asynchronous=True)),
        ("Accelerate save_state", run_accelerate(state)),
    ]
    rows = []
    for name, run in contenders:
        stall, total = bench(name.replace(" ", "_"), run, out, args.repeat)
        rows.append((name, stall, total))
        print(f"  measured {name}: stall {stall * 1e3:.0f} ms, durable after {total:.2f} s", file=sys.stderr, flush=True)
    for e in engines.values():
        e.close()
    lines = [
        f"state: {size / 1e9:.2f} GB fp32 in {len(state)} tensors; median of {args.repeat} runs after a warm-up",
        f"floor: copy_ into preallocated memory {floor * 1e3:.0f} ms ({size / floor / 1e9:.1f} GB/s)",
        "disk: parallel pwrite+fsync " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in disk.items()),
        "",
    ]
    return lines + table(["method", "stall (ms)", "stall / floor", "save→durable (s)", "GB/s", "GB/s / disk"],
                         [[name, f"{stall * 1e3:.0f}", f"{stall / floor:.2f}x", f"{total:.2f}",
                           f"{size / total / 1e9:.2f}", f"{size / total / 1e9 / best_disk:.2f}x"]
                          for name, stall, total in rows])


if __name__ == "__main__":
    sys.exit(main())
