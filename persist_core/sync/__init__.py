"""Sync: the only owner of "not yet uploaded" (committed locally, not yet on the remote).

The pipeline talks to it through one object, :class:`~persist_core.sync.syncer.Syncer` (this rank's side).
Its phases: the upload queue and its thread (:mod:`~persist_core.sync.queue`), the order uploads go in
(:mod:`~persist_core.sync.order`; what references change there, :mod:`~persist_core.sync.dependencies`), one attempt (:mod:`~persist_core.sync.upload`), the remote copy of a
checkpoint written on several nodes (:mod:`~persist_core.sync.nodes`), one writing run per ``remote_url``
(:mod:`~persist_core.sync.lease`), the remote side of a branch (:mod:`~persist_core.sync.aside`), and the
un-synced record ``persist gc`` reads (:mod:`~persist_core.sync.record`).
"""

from persist_core.sync.job import SyncJob
from persist_core.sync.queue import RemoteSync
from persist_core.sync.record import read_unsynced
from persist_core.sync.syncer import Syncer

__all__ = ["RemoteSync", "SyncJob", "Syncer", "read_unsynced"]
