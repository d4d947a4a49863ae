"""``PersistDDPStrategy``: DDP in which every rank writes its part of each checkpoint.

Lightning calls a ``CheckpointIO`` on global rank 0 only, so with plain ``strategy="ddp"`` rank 0
writes the whole (replicated) state. This subclass changes exactly two things: it gives the
plugin a gloo group of its own for the commit, and it calls the plugin's ``save_checkpoint`` on
every rank. Each rank then writes about ``1/world_size`` of the bytes; rank 0 commits the
manifest once all succeeded (see :mod:`persist_core.save.commit`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from lightning_persist.checkpoint_io import PersistCheckpointIO
from persist_core import TorchCollectives


class PersistDDPStrategy(DDPStrategy):
    """DDP whose checkpoints all ranks write: the one extra line for multi-process training.

    Example::

        io = PersistCheckpointIO(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7")
        trainer = Trainer(strategy=PersistDDPStrategy(), devices=8, plugins=[io])

    Takes DDPStrategy's arguments. ``local_dir`` may be node-local (each node commits its ranks' files
    on its own disk; the remote assembles the whole checkpoint) or one directory all ranks share.
    Without a :class:`PersistCheckpointIO` it is plain DDP.

    Args:
        commit_timeout_s: how long a rank waits for the others to finish writing one checkpoint
            before that save fails (default 1800 s).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    def __init__(self, *, commit_timeout_s: float = 1800.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._commit_timeout_s = commit_timeout_s

    def setup_distributed(self) -> None:
        super().setup_distributed()
        if isinstance(self.checkpoint_io, PersistCheckpointIO):
            self.checkpoint_io._use_collectives(TorchCollectives.new_group(timeout_s=self._commit_timeout_s))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if isinstance(self.checkpoint_io, PersistCheckpointIO):
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # every rank
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
