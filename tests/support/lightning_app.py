"""A small LightningModule, its Trainer set-up, and a script entry point for subprocess runs
(DDP launches re-run this file once per rank; SIGTERM tests kill it)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_persist import PersistCheckpointIO, PersistDDPStrategy  # noqa: E402
from persist_core import EveryNSteps  # noqa: E402

BATCHES_PER_EPOCH = 6


class Net(LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng():  # the same initial weights in every run and process
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * BATCHES_PER_EPOCH, 16, generator=g)
        y = x.sum(1, keepdim=True).sin()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def checkpoint_callback(dirpath: str | os.PathLike[str], **overrides) -> ModelCheckpoint:
    options = dict(every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)
    options.update(overrides)
    return ModelCheckpoint(dirpath=str(dirpath), **options)


def make_trainer(io: PersistCheckpointIO | None, dirpath, max_steps: int, callbacks=(), **kwargs) -> Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return Trainer(max_steps=max_steps, plugins=[io] if io is not None else None,
                   callbacks=[checkpoint_callback(dirpath), *callbacks], **options)


def linked(path) -> str:
    """The name of the checkpoint directory a Lightning path links to (itself or its shard file)."""
    from persist_core.load.paths import checkpoint_of

    return checkpoint_of(Path(os.path.realpath(path))).name


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the state dict, of the same (ordered) dict type."""
    return type(model.state_dict())((k, v.detach().clone()) for k, v in model.state_dict().items())


class CrashAt(Callback):
    """Raises a CUDA-like error at the end of optimizer step ``step`` (a crash the memory tier is for)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class TermAtStep(Callback):
    """Sends this process SIGTERM once ``step`` is reached (a preemption notice mid-run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)


class HoldAt(Callback):
    """The memory tests' kill point: from each step on, rank 0 keeps the weights (``out.stepN``); at ``step`` (after
    the autosave's snapshot: it comes after it in ``callbacks``) every rank says ``ready <step> <pid>`` and waits to
    be SIGKILLed. On a resumed run (``step`` None) each rank keeps the step and weights it resumed from instead."""

    def __init__(self, step: int | None, out: str) -> None:
        self.step, self.out = step, out

    def on_train_start(self, trainer, pl_module) -> None:
        if self.step is None:
            torch.save({"step": trainer.global_step, "weights": weights(pl_module)},
                       f"{self.out}.resumed{trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.step is None:
            return
        if trainer.is_global_zero:
            torch.save(weights(pl_module), f"{self.out}.step{trainer.global_step}")
        if trainer.global_step == self.step:
            sys.stdout.flush()  # the line in one write: the ranks share this pipe, and a print may write "\n" on its own
            os.write(1, f"ready {self.step} {os.getpid()}\n".encode())
            sys.stdin.read()  # until killed


class RankSkewed:
    """A custom save policy that would save every 3rd step on rank 0 and every 2nd elsewhere."""

    def should_save(self, context) -> bool:
        return context.step % (3 if int(os.environ.get("LOCAL_RANK", "0")) == 0 else 2) == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--remote-url")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", help="torch.save the final weights here (rank 0)")
    parser.add_argument("--term-at", type=int)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--autosave-every", type=int, help="io.autosave(EveryNSteps(N)) instead of ModelCheckpoint")
    parser.add_argument("--autosave-skewed", action="store_true",
                        help="io.autosave(a policy that answers differently on each rank) instead")
    parser.add_argument("--node-local", action="store_true",
                        help="each rank is a node of its own: local_dir (and dirpath) is LOCAL_DIR/node<rank>")
    parser.add_argument("--memory-dir", help="memory_every_n_steps=1 in this tmpfs, with io.autosave(None) (memory "
                        "only) or io.autosave(EveryNSteps(N)) with --autosave-every")
    parser.add_argument("--hold-at", type=int, help="with --memory-dir: every rank waits at this step to be killed")
    args = parser.parse_args()
    if args.node_local:
        args.local_dir = os.path.join(args.local_dir, f"node{os.environ.get('LOCAL_RANK', '0')}")
    endpoint = os.environ.get("PERSIST_TEST_S3_ENDPOINT")
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint and args.remote_url else None
    memory = dict(memory_every_n_steps=1, memory_dir=args.memory_dir) if args.memory_dir else {}
    io = PersistCheckpointIO(local_dir=args.local_dir, remote_url=args.remote_url, storage_options=options, **memory)
    extra = [TermAtStep(args.term_at)] if args.term_at else []
    strategy = PersistDDPStrategy() if args.strategy == "persist_ddp" else args.strategy
    if args.memory_dir:
        trainer = Trainer(max_steps=args.max_steps, plugins=[io], accelerator="cpu", devices=args.devices,
                          strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, callbacks=[io.autosave(EveryNSteps(args.autosave_every) if args.autosave_every else None),
                                     HoldAt(args.hold_at, args.out)])
    elif args.autosave_every or args.autosave_skewed:
        policy = RankSkewed() if args.autosave_skewed else EveryNSteps(args.autosave_every)
        trainer = Trainer(max_steps=args.max_steps, plugins=[io], accelerator="cpu", devices=args.devices,
                          strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, callbacks=[*extra, io.autosave(policy)])
    else:
        trainer = make_trainer(io, args.local_dir, args.max_steps, callbacks=extra, devices=args.devices,
                               strategy=strategy)
    model = Net(width=args.width)
    trainer.fit(model, ckpt_path=io.latest_path() if args.resume else None)
    for callback in trainer.callbacks:
        if hasattr(callback, "saved_steps"):  # the autosave callback: which steps this rank saved
            print(json.dumps({"rank": trainer.global_rank, "autosaved": callback.saved_steps}), flush=True)
    if args.out and trainer.is_global_zero:
        torch.save(weights(model), args.out)


if __name__ == "__main__":
    main()
