"""Sharded save and resharded load, side by side with torch.distributed.checkpoint (DCP), on gloo CPU ranks.

The same FSDP2 (``fully_shard``) model + Adam state (default ~1 GB in all) on 2 ranks:

* save: our stall (``save()`` returning) and save->durable (``wait()``), against ``dcp.save`` and
  ``dcp.async_save`` (its stall: the call returning; durable: its future), each rank's stall over the
  **copy floor** (a plain ``copy_`` of the rank's own local shards into preallocated memory) and
  save->durable over the **disk** (both ranks ``pwrite`` + ``fsync`` of their bytes at once);
* load with resharding 2->1 and 2->3 into fresh FSDP2 targets: ours (``engine.load(into=...)``)
  against ``dcp.load``, and the bytes each rank read over the bytes its targets needed.

Every figure is a median of ``--repeat`` runs after a warm-up, measured in this one run. Usage::

    .venv/bin/python benchmarks/bench_sharded.py [--gb 1.0] [--repeat 3] [--dir bench-out/sharded]

``--smoke``: a tiny model, one timed run, the 2 -> 1 load only, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import disk_seconds, print_table, tensors  # noqa: E402


def _exit() -> None:
    """A worker's end once every rank passed the last barrier: its figures are on disk, and tearing the gloo groups
    down (ours and DCP's async ones) sometimes aborted a rank at exit ("terminate called without an active
    exception": once in a CI run on 2026-12-06); the process ends without running those destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(gb: float, seed: int, width: int = 2048) -> torch.nn.Module:
    """Linear layers of ~``gb / 3`` GB of fp32 parameters (Adam adds two moments: ~``gb`` in all)."""
    torch.manual_seed(seed)
    params = int(gb * 1e9 / 3 / 4)
    layers = max(1, params // (width * width + width))
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def _setup(rank: int, world: int, port: int, gb: float, seed: int):
    if gb < 0.1:  # --smoke
        torch.set_num_threads(1)
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = make_model(gb, seed, width=2048 if gb >= 0.1 else 256)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _init_optim_state(opt)
    return model, opt


def _timed(fn, repeat: int) -> list[float]:
    """Median of each returned figure over ``repeat`` runs after a warm-up; every rank in step."""
    runs = []
    for i in range(repeat + 1):
        dist.barrier()
        figures = fn(i)
        if i:
            runs.append(figures)
    return [statistics.median(col) for col in zip(*runs)]


def save_rank(rank: int, world: int, port: int, gb: float, repeat: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from persist_core import CheckpointEngine, TorchCollectives

    model, opt = _setup(rank, world, port, gb, seed=1)
    coll = TorchCollectives.new_group()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    local = tensors(state)
    mine = sum(t.numel() * t.element_size() for t in local)
    work = Path(out)

    def floor(i: int) -> list[float]:
        dst = [torch.empty_like(t) for t in local] if i == 0 else floor.dst
        floor.dst = dst
        t0 = time.perf_counter()
        for d, s in zip(dst, local):
            d.copy_(s)
        return [time.perf_counter() - t0]

    mine_dir = work / f"disk-{rank}"
    mine_dir.mkdir(exist_ok=True)

    def disk(i: int) -> list[float]:
        """Both ranks at once: parallel pwrite + fsync of this rank's bytes, buffered or O_DIRECT (the faster)."""
        return [disk_seconds(mine, mine_dir, 1)]

    engine = CheckpointEngine(work / "persist", collectives=coll)

    def ours(i: int) -> list[float]:
        t0 = time.perf_counter()
        handle = engine.save(state, step=i + 1)
        stall = time.perf_counter() - t0
        handle.wait()
        return [stall, time.perf_counter() - t0]

    def dcp_sync(i: int) -> list[float]:
        d = work / f"dcp-{i}"
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(d))
        return [time.perf_counter() - t0]

    def dcp_async(i: int) -> list[float]:
        d = work / f"dcp-async-{i}"
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(d))
        stall = time.perf_counter() - t0
        fut.result()
        return [stall, time.perf_counter() - t0]

    figures = {"bytes": mine, "floor": _timed(floor, repeat)[0], "disk": _timed(disk, repeat)[0]}
    figures["ours_stall"], figures["ours_durable"] = _timed(ours, repeat)
    engine.close()
    figures["dcp_save"] = _timed(dcp_sync, repeat)[0]
    figures["dcp_async_stall"], figures["dcp_async_durable"] = _timed(dcp_async, repeat)
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        torch.save(gathered, work / "save-figures.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    _exit()


def load_rank(rank: int, world: int, port: int, gb: float, repeat: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from persist_core import CheckpointEngine, TorchCollectives

    model, opt = _setup(rank, world, port, gb, seed=2)
    coll = TorchCollectives.new_group()
    msd, osd = get_state_dict(model, opt)
    into = {"model": msd, "optim": osd}
    work = Path(out)
    saved_step = repeat + 1
    stats: list = []

    def ours(i: int) -> list[float]:
        with CheckpointEngine(work / "persist", collectives=coll) as engine:
            t0 = time.perf_counter()
            engine.load(saved_step, into=into)
            took = time.perf_counter() - t0
            s = engine.reader.last_load
            stats.append((s.needed_bytes, s.read_bytes))
        return [took]

    def theirs(i: int) -> list[float]:
        t0 = time.perf_counter()
        dcp.load(into, checkpoint_id=str(work / f"dcp-{repeat}"))
        return [time.perf_counter() - t0]

    figures = {"ours": _timed(ours, repeat)[0], "dcp": _timed(theirs, repeat)[0],
               "needed": stats[-1][0], "read": stats[-1][1]}
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        torch.save(gathered, work / f"load-{world}-figures.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    _exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="bench-out/sharded")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run, 2 -> 1 only: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.gb, args.repeat = 0.002, 1
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    work = Path(args.dir).absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(save_rank, args=(2, _port(), args.gb, args.repeat, str(work)), nprocs=2, join=True)
        save = torch.load(work / "save-figures.pt", weights_only=False)
        loads = {}
        for world in (1,) if args.smoke else (1, 3):
            mp.spawn(load_rank, args=(world, _port(), args.gb, args.repeat, str(work)), nprocs=world, join=True)
            loads[world] = torch.load(work / f"load-{world}-figures.pt", weights_only=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    total = sum(f["bytes"] for f in save)
    worst = {k: max(f[k] for f in save) for k in ("ours_stall", "dcp_async_stall", "floor", "ours_durable", "disk")}
    print(f"FSDP2 state of {total / 1e9:.2f} GB (model + Adam) on 2 gloo ranks; medians of {args.repeat} runs")
    print_table(["rank", "own bytes", "copy floor", "disk", "our stall", "/ copy floor", "DCP async stall",
                 "ours / DCP", "our save→durable", "/ disk", "dcp.save", "DCP async durable"],
                [[r, f"{f['bytes'] / 1e9:.2f} GB", f"{f['floor']:.3f} s", f"{f['disk']:.2f} s",
                  f"{f['ours_stall']:.3f} s", f"{f['ours_stall'] / f['floor']:.2f}x", f"{f['dcp_async_stall']:.3f} s",
                  f"{f['ours_stall'] / f['dcp_async_stall']:.2f}x", f"{f['ours_durable']:.3f} s",
                  f"{f['disk'] / f['ours_durable']:.2f}x", f"{f['dcp_save']:.3f} s", f"{f['dcp_async_durable']:.3f} s"]
                 for r, f in enumerate(save)], align="r" * 12)
    print(f"the step waits for the slowest rank: our stall {worst['ours_stall']:.3f}s = "
          f"{worst['ours_stall'] / worst['floor']:.2f}x the copy floor, "
          f"{worst['ours_stall'] / worst['dcp_async_stall']:.2f}x DCP async_save's {worst['dcp_async_stall']:.3f}s; "
          f"save->durable {worst['ours_durable']:.3f}s, the disk {worst['disk']:.3f}s "
          f"({worst['disk'] / worst['ours_durable']:.2f}x)")
    print_table(["2 → N", "rank", "ours", "dcp.load", "DCP / ours", "bytes needed", "bytes read", "read / needed"],
                [[world, r, f"{f['ours']:.3f} s", f"{f['dcp']:.3f} s", f"{f['dcp'] / f['ours']:.2f}x",
                  f"{f['needed'] / 1e6:.1f} MB", f"{f['read'] / 1e6:.1f} MB", f"{f['read'] / max(1, f['needed']):.3f}x"]
                 for world, figs in loads.items() for r, f in enumerate(figs)], align="r" * 8,
                title="resharded load into fresh FSDP2 targets (files in the page cache for both)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
