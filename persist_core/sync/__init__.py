"""Sync: the only owner of "not yet uploaded" (committed locally, not yet on the remote).

The pipeline talks to it through one object, :class:`~persist_core.sync.side.SyncSide` (this rank's side).
Its phases: the upload queue and its thread (:class:`~persist_core.sync.queue.UploadQueue`; its failed uploads and
retries, :mod:`~persist_core.sync.outage`), the order uploads go in (:mod:`~persist_core.sync.order`; what references
change there, :mod:`~persist_core.sync.references`), one attempt (:mod:`~persist_core.sync.upload`), the remote copy
of a checkpoint written on several nodes (:mod:`~persist_core.sync.nodes`), one writing run per ``remote_url``
(:mod:`~persist_core.sync.lease`), the remote side of a branch (:mod:`~persist_core.sync.aside`), and the
un-synced record ``persist gc`` reads (:mod:`~persist_core.sync.record`).
"""

from persist_core.sync.job import SyncJob
from persist_core.sync.queue import UploadQueue
from persist_core.sync.record import read_unsynced
from persist_core.sync.side import SyncSide

__all__ = ["SyncJob", "SyncSide", "UploadQueue", "read_unsynced"]
