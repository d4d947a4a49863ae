"""A LightningModule sharded with FSDP2 under ``PersistModelParallelStrategy``: a script the tests run
(Lightning's launcher re-runs this file once per rank)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_persist import PersistCheckpointIO, PersistModelParallelStrategy  # noqa: E402


class ShardedNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * 6, 16, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


class DumpAtStart(Callback):
    """Writes the whole model and optimizer state as restored (rank 0 gathers) before training goes on."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opt = trainer.optimizers[0]
        msd, osd = get_state_dict(pl_module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            torch.save({"model": msd, "optim": osd, "step": trainer.global_step}, self.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dump-at-start")
    args = parser.parse_args()
    io = PersistCheckpointIO(local_dir=args.local_dir, keep_last=2)
    callbacks = [ModelCheckpoint(dirpath=args.local_dir, every_n_train_steps=2, save_top_k=2, monitor="step",
                                 mode="max", save_last=True)]
    if args.dump_at_start:
        callbacks.append(DumpAtStart(args.dump_at_start))
    trainer = Trainer(max_steps=args.max_steps, accelerator="cpu", devices=args.devices, plugins=[io],
                      strategy=PersistModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
                      logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(ShardedNet(), ckpt_path=io.latest_path() if args.resume else None)
    if trainer.is_global_zero:
        print("ranks", trainer.world_size, "final step", trainer.global_step, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
