"""Overlapped snapshots: the stall of save() with engine.guard(optimizer) against without, on a real CPU step.

A model of Linear(2048) layers + Adam (about 0.6 GB of state) on this machine's CPU; per save: the
time save() blocks, the next training step (forward, backward, Adam) right after it, and how long
that step's optimizer.step() waited for the background copy (the fence). Baselines measured in the
same run: the same step with no save in flight, and the copy floor (a plain copy_ of the state into
preallocated memory). Medians of --repeat saves after a warm-up.

Second part (``--accel-rounds``, 0 to skip): the accelerator-like step of the goodput benchmark (the host
waits --step-ms of "device time", then an in-place SGD-with-momentum update of 4 x Linear(--accel-width,
default 3072) runs on the host cores) under continuous guarded saving, in blocks of --block steps interleaved in one process:
no saves (the baseline), saving with the writes yielding to the update (overlap.Turn, the default),
saving with that switched off (the behaviour before it), saving with each 32 MiB chunk in one pwrite (the
behaviour before 4 MiB pieces: what is in flight when a hold starts runs on through the update), and two
floors, both holding off during the
update as the engine's writes do: the raw writes — the state's bytes written over and over (4 threads of 32
MiB chunks in 4 MiB O_DIRECT pwrites, as a guarded engine writes them, an fsync a pass; no copy, checksums or
commit), what the disk's writes alone cost, and the same in one 32 MiB pwrite a chunk —
and the snapshot floor — on the engine's schedule (after an update, once the previous pass is done), the
state copied into a host buffer on one thread (the next update waits for the copy) and written raw to a new
file, the one before removed: what any checkpoint of this state must do (and the same with a crc32c of every
block before its pwrite, as the engine's writes checksum); the kinds' order reversed every other round (the
no-saves block first). Per block the mean step and update
times; C (what saving adds per save, or per pass) = (step with saves - step without) x steps / saves;
medians over the rounds; the share of updates that began with one of the engine's pwrites in flight (it runs on
through the update: the disk's DMA); and the update before any engine saved beside the no-saves blocks' (a save must
leave nothing behind that slows the training after it: a parallel copy on another thread once did). C over
the snapshot floor's is what the engine adds (its checksums, commit, history); the floors themselves are
what copying and writing the state cost this host's update.

    .venv/bin/python benchmarks/bench_overlap.py [--layers 12] [--repeat 5] [--accel-rounds 6] [--accel-width 3072]

``--smoke``: both parts with tiny sizes, in seconds (CI runs it; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crc32c  # noqa: E402

from benchmarks._common import (  # noqa: E402
    CHUNK, THREADS, RawWrites, accel_model, copy_floor, cpu_model, open_for_writes, print_table, tensors, write_pass)
from benchmarks._common.blocks import Beside, Saving, Writes, by_kind, cost_per_save, run_blocks  # noqa: E402
from persist_core import CheckpointEngine  # noqa: E402
from persist_core.fileio import CHECKSUM_BLOCK_BYTES, YIELD_PIECE_BYTES, OsFileOps  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048, help="the CPU step's model's width")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--accel-rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=12)
    parser.add_argument("--step-ms", type=float, default=80.0)
    parser.add_argument("--accel-width", type=int, default=3072, help="the accelerator-like model's width")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.repeat, args.accel_rounds, args.block, args.step_ms, args.accel_width = (
            1, 256, 1, 1, 2, 5.0, 256)
        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    t0 = time.perf_counter()
    cpu_step(args)
    t1 = time.perf_counter()
    if args.accel_rounds:
        accel(args)
    print(f"(took {time.perf_counter() - t0:.0f} s: the CPU step {t1 - t0:.0f} s)")
    return 0


def accel(args: argparse.Namespace) -> None:
    from persist_core import Continuous, KeepLastN

    model, opt = accel_model(args.accel_width)
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    kinds = ("no saves", "saving, writes yield", "saving, no yield", WHOLE, RAW, RAW_WHOLE, SNAPSHOT, CHECKSUMMED)
    saved = [p for p in model.parameters()] + [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    nbytes = sum(t.numel() * t.element_size() for t in saved)  # parameters and momentum
    fresh = []  # the update before any engine exists or saves: what the no-saves blocks' update should stay at
    for _ in range(args.block):
        time.sleep(args.step_ms / 1000)
        u0 = time.perf_counter()
        opt.step()
        fresh.append(time.perf_counter() - u0)
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as work:
        ops = {k: CountingOps() for k in kinds[:4]}
        engines = {k: CheckpointEngine(Path(work) / str(i), save_policy=Continuous(), keep_local=KeepLastN(1),
                                       file_ops=ops[k])
                   for i, k in enumerate(kinds[:4])}
        engines["saving, no yield"]._overlap.turn.hold = lambda: None  # the writes run through the updates
        engines[WHOLE]._overlap.turn.piece_bytes = lambda: None  # a chunk in one pwrite: it runs on through a hold
        beside: dict[str, Beside] = {
            k: Saving(e, None if k == "no saves" else state, guard=opt, count="overlapped_saves",
                      in_flight=lambda o=ops[k]: o.in_flight > 0) for k, e in engines.items()}
        beside.update({RAW: Writes(RawWrites(Path(work) / "raw", nbytes, piece=YIELD_PIECE_BYTES)),
                       RAW_WHOLE: Writes(RawWrites(Path(work) / "raw32", nbytes, piece=CHUNK)),
                       SNAPSHOT: Writes(SnapshotFloor(Path(work) / "snap", saved)),
                       CHECKSUMMED: Writes(SnapshotFloor(Path(work) / "crc", saved, checksums=True))})
        # a step: the device computes (a sleep: the host's cores are free), then the update; no saves always first
        runs = run_blocks(beside, rounds=args.accel_rounds, block=args.block,
                          compute=lambda: time.sleep(args.step_ms / 1000), update=opt.step)
        for engine in engines.values():
            engine.close()
    results = {k: [(b.step_s, b.update_s, b.done) for b in blocks] for k, blocks in by_kind(runs).items()}
    in_flight = {k: side.began if isinstance(side, Saving) else [] for k, side in beside.items()}
    med = statistics.median
    bare = med(r[0] for r in results["no saves"])
    gb = nbytes / 1e9
    print(f"\naccelerator-like step ({args.step_ms:g} ms device time + the in-place update of 4 x "
          f"Linear({args.accel_width}), {gb:.2f} GB with momentum), saving continuously, blocks of {args.block} "
          f"steps x {args.accel_rounds} rounds")
    cost, cells = {}, []
    for kind in kinds:
        step, update = med(r[0] for r in results[kind]), med(r[1] for r in results[kind])
        saves = med(r[2] for r in results[kind])
        cost[kind] = cost_per_save(runs, kind, "no saves", args.block)
        began = in_flight[kind]
        cells.append([kind, f"{step * 1e3:.1f} ms", f"{update * 1e3:.1f} ms", f"{saves:.1f}",
                      None if cost[kind] is None else f"{cost[kind] * 1e3:.1f} ms",
                      f"{sum(began) / len(began):.0%}" if began else None])
    print_table(["", "step", "update", "saves/block", "C per save", "a pwrite at its start"], cells)
    untouched, after = med(fresh[1:]), med(r[1] for r in results["no saves"])
    print(f"the update with no saves: {untouched * 1e3:.1f} ms before any engine saved, {after * 1e3:.1f} ms in the "
          f"no-saves blocks between saving ones ({after / untouched:.2f}x: above 1, saving leaves training slower)")
    if cost["saving, writes yield"] is not None and cost[WHOLE]:
        print(f"C with the chunks in {YIELD_PIECE_BYTES >> 20} MiB pwrites / in one 32 MiB pwrite each (before "
              f"2026-12-03): {cost['saving, writes yield'] / cost[WHOLE]:.2f}x")
    if cost[RAW] is not None and cost[RAW_WHOLE] is not None:
        raw, whole = (med(r[1] for r in results[k]) for k in (RAW, RAW_WHOLE))
        print(f"the raw writes held off during the update: in {YIELD_PIECE_BYTES >> 20} MiB pwrites the update ran "
              f"{raw / after:.3f}x its time with no saves, in one 32 MiB pwrite a chunk {whole / after:.3f}x (what is "
              f"in flight when the hold starts runs on through it); {cost[RAW] * 1e3:.1f} against "
              f"{cost[RAW_WHOLE] * 1e3:.1f} ms a pass, {med(r[2] for r in results[RAW]):.1f} against "
              f"{med(r[2] for r in results[RAW_WHOLE]):.1f} passes a block")
    if cost["saving, writes yield"] is not None and cost["saving, no yield"]:
        print(f"C with the writes yielding / without: {cost['saving, writes yield'] / cost['saving, no yield']:.2f}x "
              f"(a step with no saves {bare * 1e3:.1f} ms)")
    if None not in (cost["saving, writes yield"], cost[RAW], cost[SNAPSHOT], cost[CHECKSUMMED]):
        c = cost["saving, writes yield"]

        def versus(floor: float) -> str:  # a ratio to a floor within the noise says nothing: the difference does
            return f"{(c - floor) * 1e3:+.1f} ms" + (f", {c / floor:.2f}x" if floor > 1e-3 else "")

        print(f"C {c * 1e3:.1f} ms a save against the snapshot floor's {cost[SNAPSHOT] * 1e3:.1f} ms "
              f"({versus(cost[SNAPSHOT])}; the state copied into host memory after the update and written raw, on the "
              f"engine's schedule), {cost[CHECKSUMMED] * 1e3:.1f} ms with the engine's checksums added "
              f"({versus(cost[CHECKSUMMED])}), and the raw writes' {cost[RAW] * 1e3:.1f} ms a pass (the disk's writes "
              "alone); below 1 ms it is this machine's noise")


WHOLE = "saving, 32 MiB pwrites"
RAW = "raw writes (the floor)"
RAW_WHOLE = "raw, 32 MiB pwrites"
SNAPSHOT = "copy + raw writes"
CHECKSUMMED = "copy + crc + raw writes"


class CountingOps(OsFileOps):
    """The engine's file system calls, counting the pwrites in flight (to tell whether an update began with one)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        with self._lock:
            self.in_flight += 1
        try:
            return super().pwrite(fd, data, offset)
        finally:
            with self._lock:
                self.in_flight -= 1


class SnapshotFloor:
    """The floor of a snapshot on the engine's schedule: what any checkpoint of this state must do, and no more.
    After an update, when the previous pass is done (as continuous saving starts a save once the previous one
    committed), a thread copies the state into a page-aligned host buffer (the engine's copy, on one thread),
    then writes it to a new file as ``_common.RawWrites`` does (4 threads of 32 MiB chunks in pieces, holding
    off during the update, an fsync) and removes the file before it; the next update waits for the copy
    (the fence). No manifest, commit or history; ``checksums``: a crc32c of every 256 KiB block before its
    pwrite, on the writing threads, as the engine's writes compute them."""

    def __init__(self, path: Path, tensors: list[torch.Tensor], *, checksums: bool = False) -> None:
        self._path, self._tensors, self._checksums = path, tensors, checksums
        path.mkdir(parents=True, exist_ok=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._nbytes = -(-nbytes // CHUNK) * CHUNK
        self._buf = mmap.mmap(-1, self._nbytes)  # page-aligned; its pages touched once here, as the engine warms its own
        self._buf.write(b"\0" * self._nbytes)
        self._staging = torch.frombuffer(self._buf, dtype=torch.uint8)
        self._pool = ThreadPoolExecutor(THREADS)
        self.turn, self._copied = threading.Event(), threading.Event()
        self.turn.set()
        self._copied.set()
        self._thread: threading.Thread | None = None
        self.passes = 0

    def start(self) -> int:
        return self.passes

    def stop(self) -> int:
        if self._thread is not None:
            self._thread.join()
        return self.passes

    def before_update(self) -> None:
        self._copied.wait()
        self.turn.clear()

    def after_update(self) -> None:
        self.turn.set()
        if self._thread is None or not self._thread.is_alive():
            self._copied.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        from persist_core.hostmem import copy_here

        offset = 0
        for t in self._tensors:
            n = t.numel() * t.element_size()
            copy_here(self._staging[offset:offset + n].view(t.dtype).view(t.shape), t)
            offset += n
        self._copied.set()
        fd = open_for_writes(self._path / f"pass-{self.passes}")
        view = memoryview(self._buf)
        try:
            write_pass(self._pool, fd, lambda at: view[at:at + CHUNK], self._nbytes, self.turn, piece=YIELD_PIECE_BYTES,
                       checksum=crc32c.crc32c if self._checksums else None, checksum_block=CHECKSUM_BLOCK_BYTES)
        finally:
            os.close(fd)
        (self._path / f"pass-{self.passes - 1}").unlink(missing_ok=True)
        self.passes += 1


def cpu_step(args: argparse.Namespace) -> None:
    model, opt, train = cpu_model(args.width, layers=args.layers)

    def step() -> float:
        t0 = time.perf_counter()
        train()
        return time.perf_counter() - t0

    step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    floor = copy_floor(tensors(state()), args.repeat, warmup=1)
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
    print(f"state {nbytes / 1e9:.2f} GB; copy floor {floor * 1e3:.0f} ms; a step with no save {bare * 1e3:.0f} ms")
    print_table(["save", "stall", "/ floor", "next step", "/ bare step", "fence wait"],
                [["guarded" if guarded else "plain", f"{stall * 1e3:.0f} ms", f"{stall / floor:.2f}x",
                  f"{took * 1e3:.0f} ms", f"{took / bare:.2f}x", f"{fence * 1e3:.0f} ms"]
                 for guarded, (stall, took, fence) in rows.items()])
    print(f"stall with the guard / without: {rows[True][0] / rows[False][0]:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
