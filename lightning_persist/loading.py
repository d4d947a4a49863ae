"""``load_from_checkpoint(ModelClass, path)``: Lightning's loader for every checkpoint the plugin writes.

With one writer (the default strategy, and ``strategy="ddp"``) every path the plugin leaves is a
file ``torch.load`` reads, so ``ModelClass.load_from_checkpoint(path)`` works as always (and reads
the bytes without verifying them). With split writes (``PersistDDPStrategy``) a checkpoint is
one shard per rank and the path links to its directory, and with ``incremental=True`` a referencing
checkpoint's file holds only what changed: only torch-persist can put those back together. This
function does, verifying every chunk, then builds the module as Lightning does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from persist_core import CheckpointReader, ConfigError
from persist_core.load.paths import checkpoint_of


def load_from_checkpoint(cls: type, path: str | os.PathLike[str], *, map_location: Any = None,
                         strict: bool | None = None, io: Any | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for any checkpoint the plugin wrote, split or not.

    Args:
        cls: a ``LightningModule`` (or ``LightningDataModule``) class.
        path: a path the plugin saved (a link), a ``local_dir/step-N`` directory, or, with ``io``,
            anything its ``load_checkpoint`` takes (a ``remote_url/step-N`` URL).
        map_location: ``None`` (CPU), a device string or a ``torch.device``.
        strict: as for Lightning's ``load_from_checkpoint``.
        io: the :class:`PersistCheckpointIO` to load through (for remote URLs).
        **kwargs: hyper-parameters that override the saved ones, as for Lightning.

    Raises:
        CheckpointNotFoundError / CorruptCheckpointError: as the reader's ``load``.
    """
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    if not (isinstance(cls, type) and issubclass(cls, (LightningModule, LightningDataModule))):
        raise ConfigError(f"load_from_checkpoint({cls!r}, ...) needs a LightningModule or LightningDataModule class")
    device = "cpu" if map_location is None else map_location
    if io is not None:
        checkpoint = io.load_checkpoint(path, map_location=device)
    else:
        ckpt = checkpoint_of(Path(os.path.realpath(os.fspath(path))))
        with CheckpointReader(ckpt.parent) as reader:
            checkpoint = reader.load(reader.step_of(ckpt), map_location=device)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=str(path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model
