"""Sync: the only owner of "not yet uploaded" (committed locally, not yet on the remote).

The upload queue and its thread (:mod:`~persist_core.sync.queue`), the order uploads go in
(:mod:`~persist_core.sync.order`), the remote copy of a checkpoint written on several nodes
(:mod:`~persist_core.sync.nodes`), one writing run per ``remote_url`` (:mod:`~persist_core.sync.lease`).
"""

from persist_core.sync.queue import RemoteSync, SyncJob

__all__ = ["RemoteSync", "SyncJob"]
