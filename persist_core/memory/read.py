"""Reading the memory tier (issue 42): which run's snapshots a reader sees (:class:`SnapshotReads`, what the load
flow's :class:`~persist_core.load.reader.CheckpointReader` is given), a snapshot read into a state, every byte checked
against its record's checksums (a torn slot falls back to an older slot of the same step), and a partner's copy
pulled back over the wire (:class:`PartnerLink`, what :func:`~persist_core.load.agree.agreed_load` is given)."""

from __future__ import annotations

from collections.abc import Callable

import dataclasses
import logging
import os
import secrets
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from persist_core.distributed import PointToPoint
from persist_core.errors import CorruptCheckpointError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import pulled_filename
from persist_core.assembly.assemble import load_checkpoint, load_into
from persist_core.assembly.blocks import LoadStats, read_shard
from persist_core.assembly.plan import LoadOptions
from persist_core.run_ids import run_id_of
from persist_core.tiers.local import ShardFile, read_blocks
from persist_core.memory.files import local_dir_identity
from persist_core.memory.store import MemoryStore, Snapshot
from persist_core.memory.wire import BEGIN, NONE, recv_header, recv_image, send_header, send_image
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


_PULL_TAG = 3


class SnapshotReads:
    """One rank's snapshots as the load flow reads them (the source ``memory`` of the restore order): the steps,
    the newest, the step a slot's path names, a step read into a state.

    Args:
        store: the snapshots (the engine's own, or the run's that ``local_dir`` keeps the id of).
    """

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def steps(self, *, whole: bool = False) -> set[int]:
        """The steps held; ``whole``: those a whole load can read (a rank's part of sharded tensors loads into
        targets only)."""
        if not whole:
            return self.store.steps()
        return {s.step for s in self.store.snapshots() if s.manifest.part is None}

    def latest(self, *, newer_than: int) -> CheckpointInfo | None:
        return newest_snapshot(self.store, newer_than=newer_than)

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        return slot_step(self.store, path)

    def read(self, step: int, into: Any, *, options: LoadOptions, pool: Executor,
             stats: LoadStats) -> tuple[Any, Manifest]:
        return read_snapshot(self.store, step, into, options=options, pool=pool, stats=stats)


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


def newest_snapshot(store: MemoryStore | None, *, newer_than: int) -> CheckpointInfo | None:
    """The newest snapshot of ``store`` as :meth:`CheckpointReader.latest` gives it (``tier="memory"``, ``path``
    its slot), when it is newer than ``newer_than``; else ``None``."""
    snaps = [] if store is None else [s for s in store.snapshots() if s.manifest.part is None]  # a whole load's
    if not snaps or snaps[0].step <= newer_than:
        return None
    s = snaps[0]
    return CheckpointInfo(step=s.step, time=s.manifest.time, nbytes=s.manifest.nbytes, path=str(s.path), tier="memory")


def slot_step(store: MemoryStore | None, path: str | os.PathLike[str]) -> int | None:
    """The step of the snapshot whose slot ``path`` names, or ``None``."""
    if store is None:
        return None
    real = os.path.realpath(path)
    return next((s.step for s in store.snapshots() if os.path.realpath(s.path) == real), None)


def read_snapshot(store: MemoryStore, step: int, into: Any, *, options: LoadOptions, pool: Executor,
                  stats: LoadStats) -> tuple[Any, Manifest]:
    """``(the state, its manifest)`` from the newest slot holding ``step`` whose bytes verify.

    Raises:
        CorruptCheckpointError: no slot of ``step`` verifies (the last one's failure).
    """
    slots = [s for s in store.snapshots() if s.step == step]
    for i, snap in enumerate(slots):
        try:
            return read_image(snap.manifest, snap.path, into, options=options, pool=pool, stats=stats), snap.manifest
        except CorruptCheckpointError:
            if i + 1 == len(slots):
                raise
            log.warning("[step=%d] memory snapshot %s does not verify; trying another slot", step, snap.path)
    raise CorruptCheckpointError(f"no memory snapshot of step={step} is left in {store.root}")


def read_image(manifest: Manifest, path: Path, into: Any, *, options: LoadOptions, pool: Executor,
               stats: LoadStats) -> Any:
    """The state of the snapshot image in the file ``path`` (a slot, or a partner's copy pulled back), every byte
    verified: ``into`` filled in place, or read whole as a disk load reads it (tensors that shared storage when
    saved share it again: tied weights, views). A snapshot is its rank's own one-rank image: its ``PerRank``
    values are the ones it holds, whatever the reading process's rank.

    Raises:
        CorruptCheckpointError: a byte does not verify, or the file is shorter than the record says.
    """
    options = dataclasses.replace(options, rank=0)
    if into is None:
        def shard(fe: FileEntry) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            try:
                file = ShardFile(path, fe, at_least=True)
            except OSError as e:
                raise CorruptCheckpointError(f"memory snapshot {path} cannot be read ({e.strerror or e})") from e
            with file:
                return read_shard(fe, head=file.head, fill=file.fill, pool=pool, verify=options.verify,
                                  where=str(path))
        state = load_checkpoint(path, manifest, pool=pool, options=options, shard=shard)
        stats.needed_bytes = stats.read_bytes = manifest.files[0].size
        return state
    return load_into(manifest, into, pool=pool, options=options, where=str(path), stats=stats,
                     read_blocks=lambda f, first, views: read_blocks(path, f, first, views, verify=options.verify))


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

    def read(self, into: Any, *, options: LoadOptions, pool: Executor, stats: LoadStats) -> Any:
        """The state, every byte verified (:func:`read_image`)."""
        return read_image(self.manifest, self.snapshot.path, into, options=options, pool=pool, stats=stats)

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
