"""The engine in a plain PyTorch loop: save every 10 steps, then resume on a "fresh machine".

Run: python examples/engine_min.py (CPU, a few seconds; everything under a temporary directory)."""
import tempfile

import torch

from persist_core import CheckpointEngine, CheckpointNotFoundError, KeepLastN


def train(local_dir: str, remote_url: str, until: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointEngine(local_dir, remote_url=remote_url, keep_local=KeepLastN(2)) as engine:
        try:  # the newest committed checkpoint that verifies: local, else downloaded from the remote
            state = engine.load()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"]
        except CheckpointNotFoundError:  # a first run
            start = 0
        for step in range(start + 1, until + 1):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:  # returns once the state is copied; writing and uploading go on in the background
                engine.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
    return start  # leaving the block waits for the writes and uploads (and raises a failure once)


with tempfile.TemporaryDirectory(prefix="engine-min-") as tmp:
    remote = f"file://{tmp}/remote"  # any fsspec URL: s3://bucket/run-7, gs://...; or no remote_url at all
    print("machine 1 started at step", train(f"{tmp}/machine-1", remote, until=30))
    print("machine 2 (an empty local_dir) resumed at step", train(f"{tmp}/machine-2", remote, until=50))
