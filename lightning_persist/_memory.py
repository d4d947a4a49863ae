"""The memory tier on a Lightning restart: what ``load_checkpoint`` reads when ``io.latest_path()`` named a snapshot.

``io.latest_path()`` names the newest snapshot's slot when it is newer than every checkpoint on disk (each process
asks before ``fit``, before any process group exists, so every rank names rank 0's slot). Then:

* one process reads that snapshot; when it does not verify, the newest checkpoint that does;
* several ranks (``PersistDDPStrategy``: every rank has the plugin's engine) decide on rank 0's path (a broadcast on
  the training thread's channel, every rank makes it): when it names a snapshot, every rank loads the newest step
  that every rank can get, each from its own memory first, then its node's disk and the remote
  (:meth:`~persist_core.engine.CheckpointEngine.load`, which agrees across ranks). No rank reads another's snapshot,
  and a rank whose newest snapshot was never committed makes every rank resume from the step before.
"""

from __future__ import annotations

import logging
from typing import Any

from persist_core import CorruptCheckpointError
from persist_core.distributed import decision_channel
from persist_core.session import PersistSession

log = logging.getLogger(__name__)


def load_snapshot(session: PersistSession, path: str, *, into: Any, map_location: Any,
                  weights_only: bool) -> dict[str, Any] | None:
    """The state ``path`` stands for when it names a memory snapshot (rank 0's ``path``, with several ranks), else
    ``None`` (a disk or remote checkpoint: the caller reads it). Every rank calls it.

    Raises:
        CheckpointNotFoundError / CorruptCheckpointError: no step every rank can load (as ``CheckpointEngine.load``).
    """
    if session.options.memory is None:
        return None
    chan = decision_channel(session.collectives)
    several = chan is not None and chan.world_size > 1
    step = session.reader.memory_step(path) if not several or session.leader else None
    if several:
        if not chan.broadcast(step is not None):
            return None
        return session.open().load(into=into, map_location=map_location, weights_only=weights_only)
    if step is None:
        return None
    options = dict(into=into, map_location=map_location, weights_only=weights_only, rank=session.collectives.rank)
    try:
        return session.reader.load(step, **options)
    except CorruptCheckpointError as e:
        log.warning("the memory snapshot %s does not verify (%s); loading the newest checkpoint that does", path, e)
        return session.reader.load(**options)
