"""Saves through Fabric with an S3 remote, then receives SIGTERM while the upload is pending."""

from __future__ import annotations

import os
import signal
import threading
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_persist import PersistCheckpointIO  # noqa: E402


def main() -> None:
    local_dir, url = sys.argv[1], sys.argv[2]
    options = {"client_kwargs": {"endpoint_url": os.environ["PERSIST_TEST_S3_ENDPOINT"]}}
    io = PersistCheckpointIO(local_dir=local_dir, remote_url=url, storage_options=options)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(2048, 2048))  # 16 MB of weights
    fabric.save(Path(local_dir) / "fabric.ckpt", {"model": model, "step": 7})
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, with the upload still queued
    threading.Event().wait(120)  # training would go on here; the flush ends the process once it is done
    print("SIGTERM did not end the process", flush=True)


if __name__ == "__main__":
    main()
