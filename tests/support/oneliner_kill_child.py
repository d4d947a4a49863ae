"""Child for the adapters' one-liner kill test: trains with ``memory_every_n_steps=1`` alone (no autosave, no
``maybe_save``) and SIGKILLs itself right after optimizer step ``kill_at``'s update, before that step's snapshot is
offered. Each snapshot's commit is slowed down (as a large state's checksums are): without the wait before each
update, the snapshot of the step before is not committed yet when the kill comes, and two steps are lost.

Usage: ``python -m tests.support.oneliner_kill_child lightning|accelerate|hf_trainer LOCAL_DIR MEMORY_DIR KILL_AT``
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from persist_core.memory import snapshots

_real_commit = snapshots.Snapshots._commit


def _slow_commit(self, *args, **kwargs):
    threading.Event().wait(0.5)  # a large state's checksums, on a busy host
    return _real_commit(self, *args, **kwargs)


def lightning(local_dir: str, memory_dir: str, kill_at: int) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback

    from lightning_persist import PersistCheckpointIO
    from tests.support.lightning_app import Net

    class KillAfterUpdate(Callback):  # a user's callback: it runs before the entry point's (which offers the step)
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    io = PersistCheckpointIO(local_dir, memory_every_n_steps=1, memory_dir=memory_dir)
    Trainer(max_steps=kill_at + 5, plugins=[io], callbacks=[KillAfterUpdate()], accelerator="cpu", devices=1,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False).fit(Net())


def accelerate(local_dir: str, memory_dir: str, kill_at: int) -> None:
    from accelerate_persist import PersistHook
    from tests.support.accelerate_app import build, fresh_accelerator

    acc = fresh_accelerator()
    model, optimizer, loader, scheduler, counter = build(acc)
    hook = PersistHook(local_dir, memory_every_n_steps=1, memory_dir=memory_dir).register(acc)
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if hook.step == kill_at:  # after the update, before the next step begins (where its snapshot is taken)
            os.kill(os.getpid(), signal.SIGKILL)
        scheduler.step()
        optimizer.zero_grad()


def hf_trainer(local_dir: str, memory_dir: str, kill_at: int) -> None:
    from pathlib import Path

    from transformers import TrainerCallback

    from accelerate_persist import PersistTrainerCallback
    from tests.adapters.test_hf_trainer import train

    class KillAfterUpdate(TrainerCallback):  # after the callback's wait (on_pre_optimizer_step) and the update
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step + 1 == kill_at:  # the update of step kill_at (the count moves after it)
                os.kill(os.getpid(), signal.SIGKILL)

    callback = PersistTrainerCallback(local_dir, memory_every_n_steps=1, memory_dir=memory_dir)
    train(Path(local_dir).parent / "out", [callback, KillAfterUpdate()], max_steps=kill_at + 5, save_steps=100)


if __name__ == "__main__":
    snapshots.Snapshots._commit = _slow_commit
    adapter, local_dir, memory_dir, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    {"lightning": lightning, "accelerate": accelerate, "hf_trainer": hf_trainer}[adapter](local_dir, memory_dir, kill_at)
