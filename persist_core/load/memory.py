"""Reading the memory tier (issue 42): which run's snapshots a reader sees, and a snapshot read into a state, every
byte checked against its record's checksums (a torn slot falls back to an older slot of the same step)."""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from persist_core.errors import CorruptCheckpointError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.load.assemble import load_checkpoint, load_into
from persist_core.load.blocks import LoadStats, read_shard
from persist_core.load.plan import LoadOptions
from persist_core.run_ids import run_id_of
from persist_core.tiers.local import ShardFile, read_blocks
from persist_core.tiers.memory import MemoryStore, MemoryTier
from persist_core.tiers.memory_files import local_dir_identity
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


def run_store(memory: MemoryTier | None, root: Path) -> MemoryStore | None:
    """The snapshots of the run ``root`` keeps the id of (the launcher's id first, as the engine takes it)."""
    if memory is None:
        return None
    run_id = run_id_of(root, create=False)
    if run_id is None:
        log.info("no run id in %s: no memory snapshots to read", root)
        return None
    identity = local_dir_identity(root, create=False)
    if identity is None:
        log.info("%s has no identity of its own (no engine with a memory tier made it): no memory snapshots to read",
                 root)
        return None
    return memory.store(run_id, 0, root, identity)


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
