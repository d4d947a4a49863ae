"""Which checkpoint every rank loads when several ranks write: the one rank 0's ``ckpt_path`` names."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from lightning_persist._paths import path_key, remote_path
from persist_core import CheckpointReader, PersistError
from persist_core.distributed import decision_channel
from persist_core.layout import FULL
from persist_core.links import Links
from persist_core.load.paths import checkpoint_of
from persist_core.session import PersistSession

log = logging.getLogger(__name__)


def agreed_step(session: PersistSession, links: Links, get_reader: Callable[[], CheckpointReader],
                text: str) -> tuple[str, int] | None:
    """With several ranks writing (``PersistDDPStrategy``, ``PersistModelParallelStrategy``): the checkpoint
    rank 0's ``text`` names, as (kind, step), on every rank (a collective call on the training thread's channel).

    Lightning resolves ``ckpt_path`` on each rank; on node-local disks each rank's ``io.latest_path()``
    and ``last.ckpt`` are its own node's, and may name another step, or another node's copy. Rank 0
    decides; each rank then reads that step from its own ``local_dir`` and the remote. ``None``: one
    rank, or ``text`` is not one of this plugin's checkpoints (each rank loads what it names).
    """
    chan = decision_channel(session.collectives)
    if chan is None or chan.world_size == 1:
        return None
    remote = remote_path(text, session.options.remote_url)
    mine: tuple[str, int] | None = None
    try:
        key = None if remote else links.intended(path_key(text))
        if key is not None:
            handle = session.handle(key[1], key[0])
            if handle is not None:
                handle.wait_local()
            mine = (key[0], key[1])
        else:
            reader = get_reader()
            real = None if remote else checkpoint_of(Path(os.path.realpath(text)))
            if real is None or real.parent == Path(os.path.realpath(reader.local_dir)):
                mine = (FULL, reader.step_of(text))
    except (PersistError, OSError):
        mine = None  # not ours (a plain torch.save file, another run's directory): rank 0's say decides
    agreed = chan.broadcast(mine)
    if agreed is not None and agreed != mine:
        log.info("[rank=%d] loading step=%d, the checkpoint rank 0's ckpt_path names (this rank's %r names %s)",
                 session.collectives.rank, agreed[1], text, mine)
    return agreed
