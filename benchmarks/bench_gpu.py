"""What a save costs a training loop on a GPU, side by side with the peers (on the CPU too: ``--smoke``).

The loop: ``--layers`` x (Linear(``--width``) + LayerNorm), fp32, fused AdamW; a step is ``--micro`` micro-batches
of ``--batch`` x ``--width`` in bf16 autocast, forward and backward, then the update, then ``loss.item()`` (the
host waits for the device each step, as a loop that logs its loss does). The defaults are the first GPU
measurement's setting (issue 45): 16 x Linear(4096), a 3.22 GB state, about 185 ms a step on one H200.

Measured in the same run, first the floors:

* D2H: a plain ``copy_`` of the state's tensors into preallocated host memory — pinned (``non_blocking``, then a
  synchronize) and pageable; on the CPU a host memcpy, and no pinned floor;
* the disk: parallel ``pwrite`` + ``fsync`` of as many bytes, buffered and ``O_DIRECT`` (the faster counts).

Then per method a block of ``--saves`` x ``--every`` steps saving at the block's first step and every ``--every``
steps after (``Continuous`` saves whenever the previous save has committed), each block between two blocks
without saves (its baseline: their mean, so drift cancels). Per method:

* C: the extra wall time per save, (block - baseline) / saves; with the loop's slowdown, block / baseline - 1;
* blocking: how long the save call held the loop (building the state dict included; for the async peers also
  waiting for their previous save, one at a time as their docs ask); update waited: how long the next
  optimizer step waited for the save's background copy (torch-persist's guard, DCP's async staging);
* save->durable: from the call to the checkpoint durable on disk (peers that do not fsync are fsynced: Lightning's
  worker and ``torch.save`` fsync the file), and drain: from the block's end until every save is durable;
* snapshot: the checkpoint saved at the block's first step, loaded back onto the device, against a clone of
  the state taken at the save call (the baseline blocks clone too, so C is net of it): ``bit-exact`` or torn.

Methods: torch-persist unguarded, guarded (``engine.guard(optimizer)``) and guarded continuous
(``save_policy=Continuous()``, ``maybe_save`` every step); Lightning's ``AsyncCheckpointIO`` around
``TorchCheckpointIO`` (used directly, no Trainer); DCP ``async_save`` with its default stager and with a
``DefaultStager`` (pinned, async, non-blocking on CUDA; reused across saves, fresh per save on torch < 2.13,
pytorch #183413); ``torch.save``. The methods with buffers to reuse (torch-persist, the reused stager) save once
before their block. Then a cold restore onto the device (each file evicted from the page cache first): torch-persist
(checksums verified) against ``torch.load`` and DCP ``load``.

Exits 1 when a method fails or a snapshot is torn (after printing the table).

Usage::

    python benchmarks/bench_gpu.py [--quick | --smoke] [--layers 16] [--width 4096] [--batch 8192] [--micro 8]
        [--every 19] [--saves 2] [--methods guarded,torch-save,...] [--markdown PATH] [--dir bench-out/gpu]

The default run should take about 3.5 minutes on one H200 and ``--quick`` (8 layers) under 2 (estimates from the
first measurement's timings: not run on a GPU yet); ``--smoke`` runs on the CPU with a small model in seconds (CI runs
it). ``benchmarks/gpu_check.sh`` runs the default with what is left of its 6 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import copy_floor, differences, disk_gbps, drop_cached, leaves, median, table  # noqa: E402
from benchmarks._common import tree_map  # noqa: E402
from benchmarks._common.savers import Method, Save, State, all_methods  # noqa: E402


# ------------------------------------------------------------------ the training loop


class Loop:
    """The model, its fused AdamW and the step; ``state()`` is what every method saves."""

    def __init__(self, device: torch.device, *, width: int, layers: int, batch: int, micro: int) -> None:
        torch.manual_seed(0)
        self.device = device
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width, device=device), torch.nn.LayerNorm(width, device=device)]
        self.model = torch.nn.Sequential(*blocks)
        try:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        except (RuntimeError, TypeError):  # a torch without the fused kernel for this device
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, width, device=device)
        self.micro = micro

    def step(self, before_update: Callable[[], object] | None = None) -> float:
        for _ in range(self.micro):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(self.x).float().pow(2).mean()
            (loss / self.micro).backward()
        if before_update is not None:
            before_update()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def state(self, step: int) -> State:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


RESTORES = {"guarded": "torch-persist (verified)", "torch-save": "torch.load", "dcp": "DCP load"}


# ------------------------------------------------------------------ the harness


@dataclass
class Result:
    method: Method
    block_s: float = 0.0
    baseline_s: list[float] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    drain_s: float = 0.0
    checked: int = 0
    snapshot: str = "-"
    error: str | None = None


def block(loop: Loop, steps: int, every: int, first: int, method: Method | None) -> tuple[float, State, list[Save]]:
    """``steps`` steps from step ``first``, saving with ``method`` (none: the baseline); the wall time, the clone
    of the state taken at the first step (the snapshot check's reference) and the saves."""
    saves: list[Save] = []
    clone: State = {}
    loop.sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step = first + i
        loop.step(method.before_update if method is not None else None)
        if i == 0:
            clone = tree_map(lambda t: t.detach().clone(), loop.state(step))
        if method is not None and (method.continuous or i % every == 0):
            record = method.save(lambda step=step: loop.state(step), step)
            if record is not None:
                saves.append(record)
    loop.sync()
    return time.perf_counter() - t0, clone, saves


def run_method(method: Method, loop: Loop, args: argparse.Namespace, first: int, result: Result) -> None:
    steps = args.saves * args.every
    method.open(args.dir / method.key, loop, first)
    try:
        result.block_s, clone, result.saves = block(loop, steps, args.every, first, method)
        t0 = time.perf_counter()
        method.drain()
        result.drain_s = time.perf_counter() - t0
        result.checked = first
        if not result.saves or result.saves[0].step != first:
            result.snapshot = f"no save at step {first}"
        else:
            result.snapshot = differences(clone, method.load(first, loop.device, clone))
        del clone
    finally:
        method.close()


def restore(methods: dict[str, Method], results: dict[str, Result], loop: Loop, repeat: int) -> list[tuple[str, float]]:
    """Seconds to load each restore source's checked checkpoint onto the device, its files evicted first."""
    rows = []
    like = loop.state(0)
    for key, label in RESTORES.items():
        result = results.get(key)
        if result is None or result.error is not None or not result.saves:
            continue
        method = methods[key]
        times = []
        for _ in range(repeat):
            drop_cached([method.path(result.checked)])
            loop.sync()
            t0 = time.perf_counter()
            state = method.load(result.checked, loop.device, like)
            loop.sync()
            times.append(time.perf_counter() - t0)
            del state
        rows.append((label, statistics.median(times)))
    return rows


def size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def fmt(value: float | None, scale: float = 1.0, digits: int = 0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def shown_args(args: list[str]) -> list[str]:
    """The command line's options but ``--markdown PATH`` (where the report went is no part of the setting)."""
    out = []
    skip = False
    for a in args:
        if skip or a.startswith("--markdown="):
            skip = False
            continue
        if a == "--markdown":
            skip = True
            continue
        out.append(a)
    return out


def floor_seconds(floors: dict[str, Any], nbytes: int) -> tuple[float, float]:
    """The D2H floor (pinned where there is one) and the disk's durable write of ``nbytes``, in seconds."""
    d2h = floors["pinned"] if floors["pinned"] is not None else floors["pageable"]
    return d2h, nbytes / 1e9 / floors["disk_gbps"]


HEADER = ["method", "saves", "C per save (ms)", "C / D2H floor", "loop slowdown", "blocking (ms)",
          "blocking / D2H floor", "update waited (ms)", "save→durable (s)", "durable / disk floor", "drain (s)", "snapshot"]


def row(r: Result, d2h: float, disk_s: float) -> list[str]:
    """The table's row for one method (``d2h``, ``disk_s``: the floors' seconds)."""
    if r.error is not None:
        return [r.method.name, f"failed: {r.error}"] + [""] * (len(HEADER) - 2)
    base = statistics.mean(r.baseline_s)
    n = len(r.saves)
    c = (r.block_s - base) / n if n else None
    blocking = median([s.blocking_s for s in r.saves])
    waited = median([s.waited_s for s in r.saves])
    durable = median([s.durable_s for s in r.saves if s.durable_s is not None])
    return [r.method.name, str(n), fmt(c, 1e3), fmt(c and c / d2h, digits=2, suffix="x"),
            f"{(r.block_s / base - 1) * 100:+.1f}%", fmt(blocking, 1e3, 1),
            fmt(blocking and blocking / d2h, digits=2, suffix="x"), fmt(waited, 1e3, 1), fmt(durable, digits=2),
            fmt(durable and durable / disk_s, digits=2, suffix="x"), f"{r.drain_s:.2f}", r.snapshot]


def report(args: argparse.Namespace, loop: Loop, nbytes: int, ntensors: int, floors: dict[str, float | None],
           results: list[Result], restores: list[tuple[str, float]], baseline: float) -> list[str]:
    dev = loop.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    d2h, disk_s = floor_seconds(floors, nbytes)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    lines = [
        f"{datetime.date.today().isoformat()}: `python benchmarks/bench_gpu.py {shlex.join(shown_args(args.argv))}`".rstrip(),
        "",
        (f"{where}, torch {torch.__version__}, {os.cpu_count()} CPUs, directory {args.dir}. State: {args.layers} x "
        f"(Linear({args.width}) + LayerNorm), fp32, {type(loop.opt).__name__}"
        f"{' (fused)' if loop.opt.defaults.get('fused') else ''}: {size(nbytes)} in {ntensors} tensors. Step: "
        f"{args.micro} x {args.batch}x{args.width} in bf16 autocast, {baseline / (args.saves * args.every) * 1e3:.1f} ms "
        f"without saves. Blocks of {args.saves * args.every} steps, a save every {args.every} (continuous: whenever "
        "the previous has committed)."),
        "",
        "Floors: D2H " + (f"pinned {fmt(floors['pinned'], 1e3, 1)} ms ({gbps(floors['pinned']):.1f} GB/s), pageable "
                          if floors["pinned"] is not None else "(the CPU: a host memcpy) ")
        + f"{floors['pageable'] * 1e3:.1f} ms ({gbps(floors['pageable']):.1f} GB/s); the disk's durable write "
        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in floors["disks"].items()) + f" ({seconds(disk_s)}).",
        "",
    ]
    lines += table(HEADER, [row(r, d2h, disk_s) for r in results], align="l" + "r" * (len(HEADER) - 2) + "l")
    lines += ["", "C: (block - baseline) / saves, the baseline the mean of the blocks without saves before and after; "
              "blocking: the save call; update waited: the next optimizer step's wait for the save's background copy "
              "(the guard's fence, DCP's staging); Lightning's worker and torch.save fsync their file. DCP's "
              "DefaultStager: pinned, async, non-blocking on CUDA, async on the CPU; "
              + ("reused across saves." if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
                 else "a fresh one per save (torch < 2.13, pytorch #183413).")]
    if restores:
        reference = dict(restores).get("torch.load")
        lines += [""] + table([f"cold restore to {dev.type}", "s", "GB/s", "/ torch.load"],
                              [[label, f"{s:.2f}", f"{gbps(s):.2f}", fmt(reference and s / reference, digits=2, suffix="x")]
                               for label, s in restores])
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, a save every 15 steps")
    parser.add_argument("--smoke", action="store_true", help="the CPU, a small model: a check that it all runs")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="rows per micro-batch")
    parser.add_argument("--micro", type=int, default=None, help="micro-batches per step")
    parser.add_argument("--every", type=int, default=None, help="steps between saves")
    parser.add_argument("--saves", type=int, default=None, help="saves per block")
    parser.add_argument("--repeat", type=int, default=None, help="timed repeats of the floors and of each restore")
    parser.add_argument("--methods", default=",".join(m.key for m in all_methods()))
    parser.add_argument("--dir", type=Path, default=ROOT / "bench-out" / "gpu")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    preset = {"layers": 16, "width": 4096, "batch": 8192, "micro": 8, "every": 19, "saves": 2, "repeat": 1}
    if args.quick:
        preset.update(layers=8, every=15)
    if args.smoke:
        preset.update(layers=4, width=128, batch=32, micro=2, every=3, saves=2, repeat=1)
        args.device = args.device or "cpu"
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    known = {m.key for m in all_methods()}
    args.methods = [k for k in args.methods.split(",") if k]
    unknown = set(args.methods) - known
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {sorted(known)}")
    if min(args.layers, args.width, args.batch, args.micro, args.every, args.saves, args.repeat) < 1:
        parser.error("sizes, --every, --saves and --repeat must be positive")
    return args


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP without a process group
    started = time.perf_counter()
    if args.smoke:  # its tiny matmuls gain nothing from more threads; beside the saves' threads on a few busy
        torch.set_num_threads(1)  # cores, OpenMP's waits made its steps 2 to 500 ms
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    loop = Loop(args.device, width=args.width, layers=args.layers, batch=args.batch, micro=args.micro)
    for _ in range(3):  # the optimizer's state, the kernels' first calls
        loop.step()
    tensors = [t for _, t in leaves(loop.state(0))]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    cuda = args.device.type == "cuda"
    floors: dict[str, Any] = {
        "pinned": copy_floor(tensors, args.repeat, to="cpu", pin=True, warmup=1) if cuda else None,
        "pageable": copy_floor(tensors, args.repeat, to="cpu", warmup=1),
        "disks": disk_gbps(nbytes, args.dir, args.repeat),
    }
    floors["disk_gbps"] = max(floors["disks"].values())
    del tensors
    progress(f"state {size(nbytes)}; floors: D2H pinned {fmt(floors['pinned'], 1e3, 1)} ms, pageable "
             f"{floors['pageable'] * 1e3:.1f} ms; disk {floors['disk_gbps']:.2f} GB/s")
    steps = args.saves * args.every
    methods = {m.key: m for m in all_methods() if m.key in args.methods}
    baselines = [block(loop, steps, args.every, 1, None)[0]]
    results = []
    for n, method in enumerate(methods.values(), start=1):
        result = Result(method)
        try:
            run_method(method, loop, args, first=n * 100_000 + 1, result=result)
        except Exception as e:  # noqa: BLE001 -- reported in the table (and the exit status); the others still run
            result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        if result.error is not None or method.key not in RESTORES:
            shutil.rmtree(args.dir / method.key, ignore_errors=True)
        baselines.append(block(loop, steps, args.every, 1, None)[0])
        result.baseline_s = baselines[-2:]
        results.append(result)
        progress(table(HEADER, [row(result, *floor_seconds(floors, nbytes))])[-1]  # what a run cut short still shows
                 + f" block {result.block_s:.2f} s, baseline {statistics.mean(result.baseline_s):.2f} s")
    restores = restore(methods, {r.method.key: r for r in results}, loop, args.repeat)
    shutil.rmtree(args.dir, ignore_errors=True)
    lines = report(args, loop, nbytes, len(list(leaves(loop.state(0)))), floors, results, restores,
                   statistics.median(baselines))
    lines.append(f"\n(took {time.perf_counter() - started:.0f} s)")
    print("\n".join(lines))
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(lines) + "\n")
    failed = [r.method.name for r in results if r.error is not None or r.snapshot != "bit-exact"]
    if failed:
        progress(f"failed or torn: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
