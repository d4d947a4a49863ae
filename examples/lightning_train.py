"""Lightning with ``PersistCheckpointIO``: killed mid-run, resumed on a fresh machine from S3.

A small LightningModule trains on the CPU with one extra line, the plugin::

    io = PersistCheckpointIO(local_dir=..., remote_url="s3://demo/run-7", keep_every_n_steps=20)
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath=..., every_n_train_steps=5,
                                                               save_top_k=2, monitor="step", mode="max", save_last=True)])
    trainer.fit(model, ckpt_path=io.latest_path())

1. machine 1 trains and is SIGKILLed (no warning) right after a checkpoint was handed over;
2. machine 2 starts with an empty ``local_dir``: ``io.latest_path()`` finds the newest checkpoint
   on S3, ``fit`` downloads, verifies and resumes it, and finishes the run;
3. an uninterrupted reference run shows the resumed weights are bit-identical.

The remote is a local moto S3 server (started here when ``moto`` is installed, as with
``make demo``), else a ``file://`` directory. Usage: ``python examples/lightning_train.py``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples._common import child_options, finish, kill_and_resume, preempt, storage_options  # noqa: E402

TOTAL_STEPS, EVERY, KILL_AT = 40, 5, 27
BATCHES_PER_EPOCH = 5  # checkpoints fall on epoch ends, where Lightning resumes exactly


def train(local_dir: str | None, remote: str, endpoint: str | None, kill_at: int | None) -> None:
    """One machine's training process (no ``local_dir``: no checkpoints); prints one JSON line at the end."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_persist import PersistCheckpointIO

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                           torch.nn.ReLU(), torch.nn.Linear(2048, 1))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(256 * BATCHES_PER_EPOCH, 64, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()),
                                               batch_size=256)

    class Preempted(Callback):
        """SIGKILL, no warning, right after the checkpoint of step ``kill_at - 2`` was handed over."""

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == kill_at:
                preempt()

    callbacks = [Preempted()] if kill_at else []
    io = None
    if local_dir is not None:
        io = PersistCheckpointIO(local_dir=local_dir, remote_url=remote, storage_options=storage_options(endpoint),
                                 keep_every_n_steps=20)
        callbacks.append(ModelCheckpoint(dirpath=local_dir, every_n_train_steps=EVERY, save_top_k=2, monitor="step",
                                         mode="max", save_last=True))
    trainer = Trainer(max_steps=TOTAL_STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=io is not None, callbacks=callbacks,
                      plugins=[io] if io else None)
    model = Net()
    resume = io.latest_path() if io else None
    trainer.fit(model, ckpt_path=resume)
    finish(model, resumed_from=resume, step=trainer.global_step)


def main() -> int:
    return kill_and_resume(
        __file__, "lightning", "run-7", kill_at=KILL_AT,
        intro=(f"== Lightning: machine 1 trains {TOTAL_STEPS} steps, a checkpoint every {EVERY} (top 2 + last), "
               f"synced to {{remote}} (milestones every 20 steps); SIGKILL at step {KILL_AT}"),
        machine_2="== machine 2: empty local_dir, same code: trainer.fit(model, ckpt_path=io.latest_path())",
        resumed=lambda r: f"  resumed from {r['resumed_from']} and finished at step {r['step']}")


if __name__ == "__main__":
    args = child_options()
    if args.child:
        train(args.local_dir, args.remote, args.endpoint, args.kill_at)
    else:
        sys.exit(main())
