"""Kill trials through the real Lightning Trainer and Accelerate (issue 42): steps lost per SIGKILL with the memory
tier against today's disk-only continuous saving, each adapter as its users run it.

Each job trains the accelerator-like model (4 x Linear(``--width``), SGD with momentum on fixed gradients, each step
``--step-ms`` of "device time" with the host free, then the update) until it is SIGKILLed at a random step
(uniform in ``[--kill-min, --kill-max]`` steps after its start); the next trial restarts it on the same machine and
resumes from the freshest source. Per trial: steps lost = the last step the job finished - the step the restart
resumed from.

* Lightning: ``PersistCheckpointIO(local_dir, keep_last=2[, memory_every_n_steps=1])`` with
  ``callbacks=[io.autosave(Continuous())]`` (disk only: and ``io.overlap()``), resumed with
  ``trainer.fit(model, ckpt_path=io.latest_path())``; manual optimization (one ``optimizer.step()`` a step).
* Accelerate: ``PersistHook(local_dir, save_policy=Continuous(), keep_last=2[, memory_every_n_steps=1])``
  (disk only: ``overlap=True``), ``hook.resume()``, then ``hook.maybe_save()`` after each step.

Bar: <= 1 step lost in >= 99% of trials with the memory tier.

Usage: ``python benchmarks/bench_memory_adapters.py [--width 3072] [--step-ms 80] [--trials 10] [--dir bench-out]``;
``--smoke``: a tiny model, one trial of the memory tier through Accelerate (a check that it runs; its figures
mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

T0 = time.perf_counter()  # the process's start, before torch is imported: a restart's "start to first step" from here

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import MB, accel_model, kills, nbytes, training_state  # noqa: E402
from benchmarks._common.tables import print_table  # noqa: E402

ADAPTERS = ("lightning", "accelerate")
KINDS = ("memory", "disk")


def _event(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def lightning_job(local_dir: str, memory_dir: str | None, width: int, step_ms: float) -> None:
    """The Lightning job: resumes from ``io.latest_path()``, one JSON line at its start and after each step."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lightning_persist import PersistCheckpointIO
    from persist_core import Continuous

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net, _ = accel_model(width, stepped=False)  # fixed gradients: the device's backward, done

        def training_step(self, batch, batch_idx):
            time.sleep(step_ms / 1000)
            self.optimizers().step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(1 << 20, 1)), batch_size=1)

    class Report(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            _event(event="start", step=trainer.global_step, load_s=time.perf_counter() - T0)

        def on_train_batch_end(self, trainer, *args) -> None:
            _event(event="step", step=trainer.global_step)

    memory = {} if memory_dir is None else {"memory_every_n_steps": 1, "memory_dir": memory_dir}
    io = PersistCheckpointIO(local_dir, keep_last=2, **memory)
    callbacks = [io.autosave(Continuous())] + ([] if memory else [io.overlap()]) + [Report()]
    trainer = Trainer(max_steps=1 << 30, plugins=[io], callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), ckpt_path=io.latest_path())


def accelerate_job(local_dir: str, memory_dir: str | None, width: int, step_ms: float) -> None:
    """The Accelerate job: ``hook.resume()``, then ``hook.maybe_save()`` after each step."""
    from accelerate import Accelerator

    from accelerate_persist import PersistHook
    from persist_core import Continuous

    memory = {"overlap": True} if memory_dir is None else {"memory_every_n_steps": 1, "memory_dir": memory_dir}
    acc = Accelerator(cpu=True)
    model, opt = accel_model(width, stepped=False)
    model, opt = acc.prepare(model, opt)
    with PersistHook(local_dir, save_policy=Continuous(), keep_last=2, **memory).register(acc) as hook:
        step = hook.resume()
        _event(event="start", step=step, load_s=time.perf_counter() - T0)
        while True:
            time.sleep(step_ms / 1000)
            opt.step()
            step += 1
            hook.maybe_save()
            _event(event="step", step=step)


def series(adapter: str, kind: str, base: Path, memory_root: Path, args: argparse.Namespace,
           rng: random.Random) -> tuple[list[int], list[float]]:
    """``args.trials`` kills in a row on one machine: the steps each lost, and each restart's start to first step."""
    local_dir = base / f"{adapter}-{kind}"
    memory_dir = memory_root / f"{adapter}-{kind}" if kind == "memory" else None
    shutil.rmtree(local_dir, ignore_errors=True)
    command = [sys.executable, __file__, "--job", adapter, "--job-dir", str(local_dir), "--width", str(args.width),
               "--step-ms", str(args.step_ms)] + ([] if memory_dir is None else ["--job-memory", str(memory_dir)])
    series = kills.kill_series([command], args.trials, lambda: rng.randint(args.kill_min, args.kill_max))
    lost, loads = [k.lost for k in series], [k.restart.starts[0]["load_s"] for k in series]
    shutil.rmtree(local_dir, ignore_errors=True)
    if memory_dir is not None:
        shutil.rmtree(memory_dir, ignore_errors=True)
    print(f"  {adapter} {kind}: steps lost per kill {lost}", flush=True)
    return lost, loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--step-ms", type=float, default=80.0)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kill-min", type=int, default=3)
    parser.add_argument("--kill-max", type=int, default=25)
    parser.add_argument("--memory-dir", default=None, help="a tmpfs (default /dev/shm/torch-persist-bench)")
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--job", choices=ADAPTERS, help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", help=argparse.SUPPRESS)
    parser.add_argument("--job-memory", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        warnings.filterwarnings("ignore")
        (lightning_job if args.job == "lightning" else accelerate_job)(args.job_dir, args.job_memory, args.width,
                                                                       args.step_ms)
        return 0
    if args.smoke:
        args.width, args.step_ms, args.trials, args.kill_min, args.kill_max = 64, 5.0, 1, 2, 3
    base = Path(args.dir).absolute() / "memory-adapters"
    base.mkdir(parents=True, exist_ok=True)
    memory_root = kills.tmpfs_dir(args.memory_dir, "torch-persist-bench", base / "shm")
    model, opt = accel_model(args.width)
    print(f"state {nbytes(training_state(model, opt)) / MB:.0f} MB (4 x Linear({args.width}) + SGD momentum), step "
          f"{args.step_ms:.0f} ms of device time; {args.trials} kills each, {args.kill_min}-{args.kill_max} steps "
          f"after each start; memory tier in {memory_root}", flush=True)
    rng = random.Random(0)
    kinds = KINDS[:1] if args.smoke else KINDS
    adapters = ADAPTERS[1:] if args.smoke else ADAPTERS  # the smoke: Accelerate (tests/adapters run Lightning's)
    results = {(a, k): series(a, k, base, memory_root, args, rng) for a in adapters for k in kinds}
    labels = {"memory": "memory tier (every step) + disk Continuous()", "disk": "disk only, Continuous()"}
    print_table(["adapter", "saving", "steps lost per kill: P50", "max", "<= 1 step lost", "restart to first step (P50)"],
                [[adapter, labels[kind], f"{statistics.median(lost):.0f}", max(lost),
                  f"{sum(v <= 1 for v in lost)} of {len(lost)}", f"{statistics.median(loads):.1f} s"]
                 for (adapter, kind), (lost, loads) in results.items()], align="llrrrr")
    held = all(v <= 1 for (a, k), (lost, _) in results.items() if k == "memory" for v in lost)
    print(f"\nmemory tier through the adapters: every kill lost <= 1 step: {held} (bar >= 99%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
