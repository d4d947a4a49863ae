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

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOTAL_STEPS, EVERY, KILL_AFTER_SAVE = 40, 5, 25
BATCHES_PER_EPOCH = 5


def train(local_dir: str | None, remote: str, endpoint: str | None, kill_after: int | None) -> None:
    """One machine's training process; prints one JSON line at the end."""
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
        options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
        hook = PersistHook(local_dir=local_dir, remote_url=remote, storage_options=options, keep_last=2,
                           keep_every_n_steps=20)
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
                    os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL_STEPS:
                break
    if hook is not None:
        hook.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(json.dumps({"resumed_from": resumed_from, "step": step, "digest": digest}), flush=True)


def machine(local_dir: Path | None, remote: str, endpoint: str | None, kill_after: int | None = None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", "--remote", remote]
    cmd += (["--local-dir", str(local_dir)] if local_dir else []) + (["--endpoint", endpoint] if endpoint else [])
    cmd += ["--kill-after", str(kill_after)] if kill_after else []
    from examples._common import run_machine

    return run_machine(cmd, run_id='demo-run-8' if local_dir is not None else None)


def main() -> None:
    from examples._common import listing, remote_steps, remote_storage

    out = ROOT / "demo-out" / "accelerate"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with remote_storage(out, "run-8") as (remote, endpoint):
        print(f"== Accelerate: machine 1 trains {TOTAL_STEPS} steps, save_state() every {EVERY} (keep 2 + every 20th), "
              f"synced to {remote}; SIGKILL right after save_state() at step {KILL_AFTER_SAVE}")
        assert machine(out / "machine-1", remote, endpoint, kill_after=KILL_AFTER_SAVE) is None
        print(f"  killed. machine 1's local_dir: {listing(out / 'machine-1')}")
        print(f"  on the remote: steps {remote_steps(out / 'peek', remote, endpoint)}")
        print("== machine 2: empty local_dir, same code: step = hook.resume()")
        resumed = machine(out / "machine-2", remote, endpoint)
        print(f"  resumed at step {resumed['resumed_from']} and finished at step {resumed['step']}")
        print(f"  machine 2's local_dir: {listing(out / 'machine-2')}")
        reference = machine(None, remote, endpoint)
        same = resumed["digest"] == reference["digest"]
        print(f"== resumed weights bit-identical to an uninterrupted run: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local-dir", help=argparse.SUPPRESS)
    parser.add_argument("--remote", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--kill-after", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.local_dir, args.remote, args.endpoint, args.kill_after)
    else:
        main()
