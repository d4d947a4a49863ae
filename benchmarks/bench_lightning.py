"""A Lightning training loop that checkpoints every step, side by side with its alternatives.

One run, the same CPU model and data for every configuration, each in a fresh process:

* ``none``: no checkpointing (the baseline every ratio is against);
* ``torch``: Lightning's default ``TorchCheckpointIO``;
* ``async``: Lightning's ``AsyncCheckpointIO`` around it;
* ``persist``: ``PersistCheckpointIO``.

All use ``ModelCheckpoint(every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")``.
Reported per configuration: mean step time (steps after a warm-up, from batch start to batch
start, so a checkpoint's stall counts) and its overhead over ``none``; the whole ``fit`` wall
time (a configuration that defers work to its teardown pays it here); peak RSS over ``none``;
and the ``.ckpt`` files left behind (exactly 2 are expected).

The floor, measured in the same run (once per round, between the configurations): the disk's own
time to write the state's bytes durably — parallel ``pwrite`` + ``fsync``, buffered or ``O_DIRECT``,
whichever is faster (``benchmarks._common.disk_gbps``). A loop that checkpoints every step can be no faster
than max(step without checkpoints, that time); each configuration's step time is also given over it.

Usage: ``python benchmarks/bench_lightning.py [--width 3072] [--steps 30] [--rounds 2] [--dir bench-out]``;
``--smoke``: a tiny model, 6 steps, one round, every configuration in this process, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "torch", "async", "persist")


def child(mode: str, width: int, steps: int, batch: int, out: Path) -> dict:
    import logging

    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    sys.path.insert(0, str(ROOT))
    from lightning_persist import PersistCheckpointIO

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.manual_seed(0)

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            x = torch.randn(batch * 4, width)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=batch)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(time.perf_counter())

    ckpt_dir = out / mode
    io = {"none": None, "torch": TorchCheckpointIO(), "async": AsyncCheckpointIO(TorchCheckpointIO()),
          "persist": PersistCheckpointIO(local_dir=ckpt_dir)}[mode]
    timer = StepTimer()
    callbacks = [timer]
    if mode != "none":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=2, monitor="step",
                                         mode="max"))
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=mode != "none", callbacks=callbacks,
                      plugins=[io] if io is not None else None)
    t0 = time.perf_counter()
    trainer.fit(Net())
    fit_s = time.perf_counter() - t0
    warm = 3
    step_times = [b - a for a, b in zip(timer.starts[warm:], timer.starts[warm + 1 :])]
    files = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.exists() else []
    parts = {}
    if mode == "persist":  # where a checkpointing step's time goes, per save after the warm-up
        stats = [h.stats for h in io._session._saved.values() if h is not None][warm:]
        parts = {k: statistics.mean(getattr(s, k) for s in stats) for k in ("wait_s", "staging_s", "stall_s", "write_s")}
    return {"mode": mode, "step_s": statistics.mean(step_times), "fit_s": fit_s,
            "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "files": files, **parts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="each mode runs this often, interleaved")
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one round, each configuration in this process: a check that it runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.steps, args.batch, args.rounds = 64, 6, 8, 1
        import torch

        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    out = Path(args.dir).absolute() / "lightning"
    if args.child:
        print(json.dumps(child(args.child, args.width, args.steps, args.batch, out)))
        return 0

    state_gb = 4 * (args.width * args.width + args.width) * 4 * 3 / 1e9
    print(f"Lightning loop, 4 x Linear({args.width}) + Adam (state {state_gb:.2f} GB), batch {args.batch}, "
          f"{args.steps} steps, checkpoint every step (save_top_k=2); {args.rounds} rounds, interleaved")
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import disk_gbps, print_table

    results: dict[str, list[dict]] = {m: [] for m in MODES}
    disk: list[float] = []
    for _ in range(args.rounds):
        out.mkdir(parents=True, exist_ok=True)
        disk.append(max(disk_gbps(int(state_gb * 1e9), out, repeat=2).values()))
        for mode in MODES:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if args.smoke:  # one process for all: the same code, without a fresh interpreter (and Lightning) each
                results[mode].append(child(mode, args.width, args.steps, args.batch, out))
                continue
            run = subprocess.run([sys.executable, __file__, "--child", mode, "--width", str(args.width), "--steps",
                                  str(args.steps), "--batch", str(args.batch), "--dir", args.dir],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if run.returncode != 0:
                sys.exit(f"{mode} failed:\n{run.stderr[-3000:]}")
            results[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
    shutil.rmtree(out, ignore_errors=True)

    base = {k: statistics.median(r[k] for r in results["none"]) for k in ("step_s", "fit_s", "rss_gb")}
    durable_s = state_gb / statistics.median(disk)
    floor_s = max(base["step_s"], durable_s)
    print(f"floor: the disk writes the state durably in {durable_s * 1000:.0f} ms ({statistics.median(disk):.2f} GB/s, "
          f"rounds {', '.join(f'{g:.2f}' for g in disk)} GB/s); a step without checkpoints takes "
          f"{base['step_s'] * 1000:.0f} ms; so a step that checkpoints takes at least {floor_s * 1000:.0f} ms")
    rows = []
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in results[mode]) for k in ("step_s", "fit_s", "rss_gb")}
        files = sorted({len(r["files"]) for r in results[mode]})
        rows.append([mode, f"{med['step_s'] * 1000:.0f} ms", f"{(med['step_s'] / base['step_s'] - 1) * 100:+.0f}%",
                     f"{med['step_s'] / floor_s:.2f}x", f"{med['fit_s']:.1f} s", f"{med['rss_gb']:.2f} GB",
                     f"{med['rss_gb'] / base['rss_gb']:.2f}x", "/".join(map(str, files)) if mode != "none" else None])
    print_table(["configuration", "step time", "overhead", "step / floor", "fit wall time", "peak RSS", "RSS vs none",
                 ".ckpt files left"], rows)
    p = {k: statistics.median(r[k] for r in results["persist"]) for k in ("wait_s", "staging_s", "stall_s", "write_s")}
    rest = statistics.median(r["step_s"] for r in results["persist"]) - base["step_s"] - p["stall_s"]
    print(f"\npersist, per checkpointing step: {base['step_s'] * 1000:.0f} ms of training + {p['stall_s'] * 1000:.0f} ms "
          f"stalled in save() ({p['wait_s'] * 1000:.0f} ms waiting for the previous write to free its bytes, "
          f"{p['staging_s'] * 1000:.0f} ms copying) + {rest * 1000:.0f} ms the step ran slower while the write ran "
          f"(CPU and memory-bandwidth contention); the write itself took {p['write_s'] * 1000:.0f} ms against the "
          f"disk's {durable_s * 1000:.0f} ms alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
