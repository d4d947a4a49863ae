"""What a Lightning path, ``map_location`` or ``weights_only`` means to the plugin."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from persist_core import ConfigError
from persist_core.layout import FULL, MANIFEST_NAME, WEIGHTS_ONLY, is_url
from persist_core.load.paths import checkpoint_of


def path_key(path: str | os.PathLike[str]) -> str:
    """The absolute local path a Lightning path names (``file://`` stripped).

    Raises:
        ConfigError: ``path`` is remote (``ModelCheckpoint(dirpath=...)`` must be local).
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_url(text):
        raise ConfigError(
            f"checkpoint path {text!r} is remote; PersistCheckpointIO writes to local_dir and uploads to remote_url, "
            "so point ModelCheckpoint(dirpath=...) at a local directory and pass the URL as remote_url"
        )
    return os.path.abspath(text)


def shard_checkpoint(path: str) -> Path | None:
    """The committed checkpoint directory whose shard file ``path`` is (through links), or ``None``."""
    real = Path(os.path.realpath(path))
    ckpt = checkpoint_of(real)
    return ckpt if ckpt != real and (ckpt / MANIFEST_NAME).is_file() else None


def kind_of(checkpoint: dict[str, Any]) -> str:
    """``weights-only`` for what Lightning's ``dump_checkpoint(weights_only=True)`` makes, else ``full``."""
    lightning = "pytorch-lightning_version" in checkpoint and "state_dict" in checkpoint
    return WEIGHTS_ONLY if lightning and "optimizer_states" not in checkpoint else FULL


def restricted(weights_only: bool | None) -> bool:
    """Lightning passes ``None`` for "torch.load's default", which is restricted unpickling since torch 2.6."""
    return True if weights_only is None else weights_only


def device(map_location: Any) -> Any:
    """The device a load goes to: the CPU for ``None``.

    Raises:
        ConfigError: a ``map_location`` that is not ``None``, a device string or a ``torch.device``.
    """
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, torch.device)):
        return map_location
    raise ConfigError(f"map_location={map_location!r} is not supported; pass None (CPU), a device string or a torch.device")


def remote_path(text: str, remote_url: str | None) -> bool:
    """``text`` names remote storage: an fsspec URL, or a checkpoint under ``remote_url`` (``file://`` too: a
    fresh machine's ``io.latest_path()`` on a ``file://`` remote is such a URL, not another run's ``local_dir``)."""
    return is_url(text) or (remote_url is not None and text.rstrip("/").startswith(remote_url.rstrip("/") + "/"))
