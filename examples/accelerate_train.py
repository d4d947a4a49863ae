"""Accelerate with ``PersistHook``: killed mid-run, resumed on a fresh machine from S3.

The training loop is plain Accelerate; the hook is two lines, and ``accelerator.save_state()``
stays where it was::

    hook = PersistHook(local_dir=..., remote_url="s3://demo/run-8", keep_last=2, keep_every_n_steps=20)
    hook.register(accelerator)
    step = hook.resume()                  # 0 on a first run
    ...
    accelerator.save_state()              # returns once staged; writes and uploads in the background

1. machine 1 trains and is SIGKILLed (no warning) right after a save was handed over;
2. machine 2 starts with an empty ``local_dir``: ``hook.resume()`` downloads, verifies and restores
   the newest checkpoint on S3 (model, optimizer, scheduler, RNG states, registered objects) and
   the loop goes on from that step;
3. an uninterrupted reference run shows the resumed weights are bit-identical.

The remote is a local moto S3 server when ``moto`` is installed (``make demo``), else a
``file://`` directory. Usage: ``python examples/accelerate_train.py``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples._common import child_options, finish, kill_and_resume, preempt, storage_options  # noqa: E402

TOTAL_STEPS, EVERY, KILL_AFTER_SAVE = 40, 5, 25
BATCHES_PER_EPOCH = 5


def train(local_dir: str | None, remote: str, endpoint: str | None, kill_after: int | None) -> None:
    """One machine's training process (no ``local_dir``: no checkpoints); prints one JSON line at the end."""
    import torch
    from accelerate import Accelerator

    from accelerate_persist import PersistHook

    warnings.filterwarnings("ignore")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256 * BATCHES_PER_EPOCH, 64, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=256)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    hook = None
    step = 0
    if local_dir is not None:
        hook = PersistHook(local_dir=local_dir, remote_url=remote, storage_options=storage_options(endpoint),
                           keep_last=2, keep_every_n_steps=20)
        hook.register(accelerator)
        step = hook.resume()
    resumed_from = step
    while step < TOTAL_STEPS:
        batches = accelerator.skip_first_batches(loader, step % len(loader)) if step % len(loader) else loader
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if hook is not None and step % EVERY == 0:
                accelerator.save_state()
                if step == kill_after:
                    preempt()
            if step == TOTAL_STEPS:
                break
    if hook is not None:
        hook.close()
    finish(model, resumed_from=resumed_from, step=step)


def main() -> int:
    return kill_and_resume(
        __file__, "accelerate", "run-8", kill_at=KILL_AFTER_SAVE,
        intro=(f"== Accelerate: machine 1 trains {TOTAL_STEPS} steps, save_state() every {EVERY} (keep 2 + every "
               f"20th), synced to {{remote}}; SIGKILL right after save_state() at step {KILL_AFTER_SAVE}"),
        machine_2="== machine 2: empty local_dir, same code: step = hook.resume()",
        resumed=lambda r: f"  resumed at step {r['resumed_from']} and finished at step {r['step']}")


if __name__ == "__main__":
    args = child_options()
    if args.child:
        train(args.local_dir, args.remote, args.endpoint, args.kill_at)
    else:
        sys.exit(main())
