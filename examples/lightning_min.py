"""Lightning with PersistCheckpointIO: checkpoint, then resume on a "fresh machine".

Run: python examples/lightning_min.py (CPU, a few seconds; everything under a temporary directory)."""
import tempfile

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_persist import PersistCheckpointIO


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, _):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(160, 32)), batch_size=16)


def train(local_dir: str, remote_url: str, max_steps: int) -> str | None:
    io = PersistCheckpointIO(local_dir=local_dir, remote_url=remote_url, keep_last=2)  # s3://bucket/run-7, ...
    every_10 = ModelCheckpoint(dirpath=local_dir, every_n_train_steps=10, save_last=True)
    trainer = Trainer(max_steps=max_steps, plugins=[io], callbacks=[every_10], accelerator="cpu", logger=False)
    resume = io.latest_path()  # None on a first run; the newest checkpoint, local, else on the remote
    trainer.fit(Net(), ckpt_path=resume)  # returns with every checkpoint committed and uploaded
    return resume


with tempfile.TemporaryDirectory(prefix="lightning-min-") as tmp:
    remote = f"file://{tmp}/remote"
    print("machine 1 resumed from", train(f"{tmp}/machine-1", remote, max_steps=20))
    print("machine 2 (an empty local_dir) resumed from", train(f"{tmp}/machine-2", remote, max_steps=40))
