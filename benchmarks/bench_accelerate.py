"""``accelerator.save_state()`` with ``PersistHook`` against Accelerate's own, on one model, one run.

* floor: a plain ``copy_`` of every tensor of the state (model + AdamW) into preallocated
  host memory — the least any snapshot can cost;
* Accelerate: ``accelerator.save_state(dir)`` as shipped (synchronous; its files fsynced after,
  so "durable" means the same for both);
* hook: ``accelerator.save_state()`` with ``PersistHook`` registered; durable = ``hook.wait()``.

Reported: the training-visible stall (the call's duration) and the time until durable, medians
of ``--repeat`` saves, with an optimizer step between saves. Bars: hook stall <= 1.5x the floor,
and at least 5x lower than Accelerate's.

Usage: ``python benchmarks/bench_accelerate.py [--layers 6] [--width 4096] [--repeat 3] [--dir bench-out]``;
``--smoke``: 2 x Linear(256), one save each, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_persist import PersistHook  # noqa: E402
from benchmarks._common import copy_floor, fsync_tree, print_table, tensors  # noqa: E402


def setup(layers: int, width: int):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train_step(acc, model, opt, width: int) -> None:
    acc.backward(model(torch.randn(2, width)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one save each: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.repeat = 2, 256, 1
    warnings.filterwarnings("ignore")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    out = Path(args.dir).absolute() / "accelerate"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    acc, model, opt = setup(args.layers, args.width)
    train_step(acc, model, opt, args.width)
    state = tensors([model.state_dict(), opt.state_dict()["state"]])
    nbytes = sum(t.numel() * t.element_size() for t in state)
    print(f"state: {args.layers} x Linear({args.width}) + AdamW = {nbytes / 1e9:.2f} GB, {args.repeat} saves each")
    floor_s = copy_floor(state, args.repeat, warmup=1)

    plain_stall, plain_durable = [], []
    for i in range(args.repeat):
        train_step(acc, model, opt, args.width)
        target = out / f"plain-{i}"
        t0 = time.perf_counter()
        acc.save_state(str(target))
        t1 = time.perf_counter()
        fsync_tree(target)
        plain_stall.append(t1 - t0)
        plain_durable.append(time.perf_counter() - t0)
        shutil.rmtree(target)

    hook_stall, hook_durable = [], []
    with PersistHook(local_dir=out / "hook", keep_last=1).register(acc) as hook:
        for _ in range(args.repeat + 1):  # the first save allocates the staging buffer
            train_step(acc, model, opt, args.width)
            t0 = time.perf_counter()
            acc.save_state()
            t1 = time.perf_counter()
            hook.wait()
            hook_stall.append(t1 - t0)
            hook_durable.append(time.perf_counter() - t0)
    shutil.rmtree(out, ignore_errors=True)

    rows = [("copy_ floor", floor_s, None), ("Accelerate save_state", statistics.median(plain_stall),
                                             statistics.median(plain_durable)),
            ("save_state with PersistHook", statistics.median(hook_stall[1:]), statistics.median(hook_durable[1:]))]
    print_table(["method", "stall (ms)", "stall / floor", "save→durable (s)", "GB/s to durable"],
                [[name, f"{stall * 1e3:.0f}", f"{stall / floor_s:.2f}x", None if durable is None else f"{durable:.2f}",
                  None if durable is None else f"{nbytes / durable / 1e9:.2f}"] for name, stall, durable in rows])
    hook_s, plain_s = rows[2][1], rows[1][1]
    print(f"\nhook stall / floor = {hook_s / floor_s:.2f}x (bar <= 1.5x); Accelerate's stall / hook's = "
          f"{plain_s / hook_s:.1f}x (bar >= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
