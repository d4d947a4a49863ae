"""What writes in flight cost the update that holds them off, by the size of one pwrite.

The accelerator-like step of ``bench_overlap.py`` (the host waits --step-ms of "device time", then the in-place
SGD-with-momentum update of 4 x Linear(--accel-width)) in blocks of --block steps: a block with no writes, then
one with the raw floor's writes running (``benchmarks._common.RawWrites``: 4 threads of 32 MiB chunks, ``O_DIRECT``,
an fsync a pass, each pwrite waiting while the update runs) in pwrites of each --pieces size, interleaved,
the order reversed every other round. A hold stops the next pwrite; what is in flight when it starts (the
disk's DMA) runs on through the update. Per size: the update's median time over the no-writes blocks' (the
slowdown the writes in flight cause) and the bytes written per second of the block (what the size costs the
disk's throughput). ``fileio.YIELD_PIECE_BYTES`` is the size a guarded engine writes in.

    .venv/bin/python benchmarks/bench_pieces.py [--pieces 32,8,4,2,1] [--rounds 5]

``--smoke``: two sizes, one round of two steps, a tiny model, in seconds (CI runs it).
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

from benchmarks._common import RawWrites, accel_model, alternate, print_table  # noqa: E402
from benchmarks._common.blocks import Nothing, Writes, run_blocks  # noqa: E402
from persist_core.fileio import YIELD_PIECE_BYTES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pieces", default="32,8,4,2,1", help="pwrite sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=12)
    parser.add_argument("--step-ms", type=float, default=80.0)
    parser.add_argument("--accel-width", type=int, default=3072)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.pieces, args.rounds, args.block, args.step_ms, args.accel_width = "32,4", 1, 2, 5.0, 256
        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    sizes = [int(p) << 20 for p in args.pieces.split(",")]
    model, opt = accel_model(args.accel_width)
    nbytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters and momentum

    slowdown: dict[int, list[float]] = {s: [] for s in sizes}
    speed: dict[int, list[float]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(prefix="bench-pieces-") as work:
        floors = {s: RawWrites(Path(work) / f"raw-{s}", nbytes, piece=s) for s in sizes}
        beside = {"no writes": Nothing(), **{str(s): Writes(floors[s]) for s in sizes}}
        # per size, a block with no writes, then one with the writes (their pass in flight at the end finished)
        runs = run_blocks(beside, rounds=args.rounds, block=args.block, compute=lambda: time.sleep(args.step_ms / 1000),
                          update=opt.step, order=lambda r: [k for s in alternate(sizes, r) for k in ("no writes", str(s))],
                          drain_inside=True)
    for bare, held in zip(runs[::2], runs[1::2]):
        s = int(held.kind)
        slowdown[s].append(held.update_median_s / bare.update_median_s)
        speed[s].append(held.done * floors[s].pass_bytes / held.took_s)
    med = statistics.median
    print(f"the update of 4 x Linear({args.accel_width}) ({nbytes / 1e9:.2f} GB with momentum) after {args.step_ms:g} ms "
          f"of device time, with 4 threads writing the same bytes raw, held off during it; {args.rounds} rounds of "
          f"{args.block} steps")
    ref = med(speed[32 << 20]) if 32 << 20 in speed else None
    print_table(["pwrite", "update / no writes", "written", "/ 32 MiB pwrites", ""],
                [[f"{s >> 20} MiB", f"{med(slowdown[s]):.3f}x", f"{med(speed[s]) / 1e9:.2f} GB/s",
                  f"{med(speed[s]) / ref:.2f}x" if ref else None, "<- fileio.YIELD_PIECE_BYTES" if s == YIELD_PIECE_BYTES else ""]
                 for s in sizes], align="rrrrl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
