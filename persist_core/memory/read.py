"""Reading the memory tier (issue 42): which run's snapshots a reader sees (:func:`run_store`: the
:class:`~persist_core.memory.store.MemoryStore` the load flow's :class:`~persist_core.load.reader.CheckpointReader`
reads as one more :class:`~persist_core.tiers.tier.HostReader`, each slot a copy of its own, so a torn slot passes
the load to an older slot of the same step), and a partner's copy pulled back over the wire (:class:`PartnerLink`,
what :func:`~persist_core.load.agree.agreed_load` is given; the copy, a
:class:`~persist_core.memory.store.Snapshot`, read as any memory copy is)."""

from __future__ import annotations

from collections.abc import Callable

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path


from persist_core.distributed import PointToPoint
from persist_core.format.manifest import Manifest
from persist_core.layout import pulled_filename
from persist_core.run_ids import run_id_of
from persist_core.memory.files import local_dir_identity
from persist_core.memory.store import MemoryStore, Snapshot
from persist_core.memory.wire import BEGIN, NONE, recv_header, recv_image, send_header, send_image

log = logging.getLogger(__name__)


_PULL_TAG = 3


def run_store(make_store: Callable[[str, str], MemoryStore], root: Path) -> MemoryStore | None:
    """The snapshots of the run ``root`` keeps the id of (the launcher's id first, as the engine takes it):
    ``make_store(run_id, identity)`` (``None``: no run id or no identity there, said why)."""
    run_id = run_id_of(root, create=False)
    if run_id is None:
        log.info("no run id in %s: no memory snapshots to read", root)
        return None
    identity = local_dir_identity(root, create=False)
    if identity is None:
        log.info("%s has no identity of its own (no engine with a memory tier made it): no memory snapshots to read",
                 root)
        return None
    return make_store(run_id, identity)


@dataclass(frozen=True)
class Pulled:
    """A partner's copy pulled back for one load: its manifest and the file it was received into (this rank's)."""

    snapshot: Snapshot

    @property
    def step(self) -> int:
        return self.snapshot.step

    @property
    def manifest(self) -> Manifest:
        return self.snapshot.manifest

    @property
    def copy(self) -> Snapshot:
        """The copy, read as any memory copy is (:class:`~persist_core.tiers.tier.HostReader`)."""
        return self.snapshot

    def discard(self) -> None:
        """The load is over: the file goes."""
        self.snapshot.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class PartnerLink:
    """What a rank needs to restore through the partner copies.

    Args:
        p2p: a channel of its own for the restore's messages (the training thread's).
        source: the rank whose copies this rank holds (``None``: none), in ``held``.
        held: ``memory_dir/<run-id>/partner-of-rank-<source>``.
        scratch: where a copy pulled back goes while it is read (this rank's memory directory).
        chunk_bytes: the size of each message.
    """

    p2p: PointToPoint
    source: int | None
    held: MemoryStore | None
    scratch: Path
    chunk_bytes: int = 64 << 20

    def held_steps(self, *, whole: bool = False) -> dict[int, list[int]]:
        """``{source: the steps held for it}`` (empty without a source); ``whole``: those a whole load can read (a
        rank's part of sharded tensors loads into targets only)."""
        if self.source is None or self.held is None:
            return {}
        return {self.source: sorted({s.step for s in self.held.snapshots() if not whole or s.manifest.part is None})}

    def exchange(self, pulls: list[tuple[int, int]], step: int, rank: int) -> Pulled | None:
        """Walk ``pulls`` (``(holder, puller)``, the same list on every rank), one at a time: a holder sends its copy
        of ``step`` (``NONE`` when it has none now), its puller receives it into a file of its own. The copy this
        rank pulled (verified), or ``None``."""
        pulled = None
        for holder, puller in pulls:
            if rank not in (holder, puller):
                continue
            if rank == holder:  # it always answers, so its puller never waits for nothing
                try:
                    snap = self._held_snapshot(step)
                except OSError as e:
                    log.warning("[rank=%d][step=%d] the partner copies cannot be listed: %s", rank, step, e)
                    snap = None
                if snap is None:
                    send_header(self.p2p, puller, _PULL_TAG, NONE, step)
                else:
                    send_image(self.p2p, puller, _PULL_TAG, snap, chunk_bytes=self.chunk_bytes)
                continue
            header = recv_header(self.p2p, holder, _PULL_TAG)
            if header[0] != BEGIN:
                log.warning("[rank=%d][step=%d] rank %d no longer holds the partner copy", rank, step, holder)
                continue
            path: Path | None = self.scratch / pulled_filename(secrets.token_hex(8))
            try:
                self.scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:  # the image is still received (and dropped): the holder never waits
                log.warning("[rank=%d][step=%d] no room for a pulled partner copy in %s: %s", rank, step, self.scratch,
                            e)
                path = None
            _, manifest = recv_image(self.p2p, holder, _PULL_TAG, header, path, chunk_bytes=self.chunk_bytes)
            if manifest is None or path is None:
                if path is not None:
                    path.unlink(missing_ok=True)
                continue
            pulled = Pulled(Snapshot(manifest, path))
            log.info("[rank=%d][step=%d] pulled the partner copy back from rank %d (%d bytes)", rank, step, holder,
                     os.path.getsize(path))
        return pulled

    def _held_snapshot(self, step: int) -> Snapshot | None:
        if self.held is None:
            return None
        return next((s for s in self.held.snapshots() if s.step == step), None)
