"""Which checkpoint a path names: its local directory, a link to it (or to its single shard file, as the Lightning
plugin's paths are), or its remote URL — for the reader's ``step_of`` and the adapters' links."""

from __future__ import annotations

import os
from pathlib import Path

from persist_core.errors import CheckpointNotFoundError
from persist_core.layout import parse_checkpoint_dirname, parse_shard_filename


def checkpoint_of(real: Path) -> Path:
    """The checkpoint directory ``real`` names: itself, or the directory of the shard file it is."""
    if parse_shard_filename(real.name) is not None and parse_checkpoint_dirname(real.parent.name) is not None:
        return real.parent
    return real


def step_named(text: str, root: Path, remote_url: str | None) -> int:
    """The step of the checkpoint ``text`` names in ``root`` or under ``remote_url``.

    Raises:
        CheckpointNotFoundError: ``text`` names no checkpoint of those tiers.
    """
    if remote_url is not None and text.startswith(remote_url + "/"):
        step = parse_checkpoint_dirname(text[len(remote_url) + 1:])
    else:
        real = checkpoint_of(Path(os.path.realpath(text)))
        step = parse_checkpoint_dirname(real.name) if real.parent == Path(os.path.realpath(root)) else None
    if step is None:
        where = str(root) + (f" or {remote_url}" if remote_url else "")
        raise CheckpointNotFoundError(f"{text!r} is not a checkpoint directory of {where} (a step-NNNNNNNNNNNN entry)")
    return step
