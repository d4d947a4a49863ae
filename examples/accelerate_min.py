"""Accelerate with PersistHook: save_state() as usual, then resume on a "fresh machine".

Run: python examples/accelerate_min.py (CPU, a few seconds; everything under a temporary directory)."""
import tempfile

import torch
from accelerate import Accelerator

from accelerate_persist import PersistHook


def train(local_dir: str, remote_url: str, until: int) -> int:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(160, 32)), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    hook = PersistHook(local_dir=local_dir, remote_url=remote_url, keep_last=2)  # remote: s3://bucket/run-7, ...
    hook.register(accelerator)  # save_state()/load_state() now go through the engine
    start = step = hook.resume()  # the newest committed checkpoint (local, else the remote's); 0 on a first run
    while step < until:  # one optimizer step a batch: a checkpoint's step counts optimizer steps
        skip = step % len(loader)  # batches of this epoch seen before the checkpoint
        for (x,) in accelerator.skip_first_batches(loader, skip) if skip else loader:
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                accelerator.save_state()  # returns once staged; writing and uploading go on in the background
            if step == until:
                break
    hook.close()  # waits for every commit and upload, raises a background failure once, unregisters
    return start


with tempfile.TemporaryDirectory(prefix="accelerate-min-") as tmp:
    remote = f"file://{tmp}/remote"
    print("machine 1 started at step", train(f"{tmp}/machine-1", remote, until=20))
    print("machine 2 (an empty local_dir) resumed at step", train(f"{tmp}/machine-2", remote, until=40))
