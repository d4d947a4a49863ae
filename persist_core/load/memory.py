"""Reading the memory tier (issue 42): which run's snapshots a reader sees, and a snapshot read into a state, every
byte checked against its record's checksums (a torn slot falls back to an older slot of the same step)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from persist_core import _knobs
from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.layout import RUN_ID_NAME
from persist_core.load.assemble import load_into
from persist_core.load.blocks import LoadStats
from persist_core.load.plan import LoadOptions
from persist_core.sidefiles import read_side_file
from persist_core.tiers.local import read_blocks
from persist_core.tiers.memory import MemoryStore, MemoryTier
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


def run_store(memory: MemoryTier | None, root: Path) -> MemoryStore | None:
    """The snapshots of the run ``root`` keeps the id of (the launcher's id first, as the engine takes it)."""
    if memory is None:
        return None
    run_id = _knobs.run_id_from_env()
    if run_id is None:
        try:
            run_id = read_side_file(root / RUN_ID_NAME).decode().strip() or None
        except (OSError, UnicodeDecodeError, ConfigError):
            run_id = None
    if run_id is None:
        log.info("no run id in %s: no memory snapshots to read", root)
        return None
    return memory.store(run_id, 0, root)


def newest_snapshot(store: MemoryStore | None, *, newer_than: int) -> CheckpointInfo | None:
    """The newest snapshot of ``store`` as :meth:`CheckpointReader.latest` gives it (``tier="memory"``, ``path``
    its slot), when it is newer than ``newer_than``; else ``None``."""
    snaps = [] if store is None else store.snapshots()
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
            state = load_into(snap.manifest, {} if into is None else into, pool=pool, options=options,
                              where=str(snap.path), stats=stats,
                              read_blocks=lambda f, first, views, p=snap.path: read_blocks(
                                  p, f, first, views, verify=options.verify))
            return state, snap.manifest
        except CorruptCheckpointError:
            if i + 1 == len(slots):
                raise
            log.warning("[step=%d] memory snapshot %s does not verify; trying another slot", step, snap.path)
    raise CorruptCheckpointError(f"no memory snapshot of step={step} is left in {store.root}")
