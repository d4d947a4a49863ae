"""Every slot directory of a run, for the ``persist`` command (``persist ls``'s memory snapshots, ``persist gc
--memory``): each rank's lives and the partner copies this node holds, and those no live process holds removed."""

from __future__ import annotations

from pathlib import Path

from persist_core.memory.files import all_ours, local_dir_identity, ours, remove_life
from persist_core.layout import parse_partner_dirname
from persist_core.memory.store import MemoryStore, Snapshot, _unlocked

import os


def _stores(base: Path, run_id: str, local_dir: Path | None, check_base: bool) -> list[MemoryStore]:
    """Run ``run_id``'s stores under ``base`` as ``local_dir`` answers for them: each rank's of its identity, and
    the partner copies this node holds for other ranks (the run's, whatever the local_dir)."""
    run = base / run_id
    if not all_ours([base, run] if check_base else [run]):
        return []
    identity = None if local_dir is None else (local_dir_identity(local_dir, create=False) or "")
    try:
        names = sorted(os.listdir(run))
    except OSError:
        return []
    stores = []
    for n in names:
        partner = parse_partner_dirname(n) is not None
        if (n.startswith("rank-") or partner) and ours(run / n):
            stores.append(MemoryStore(run / n, identity=None if partner else identity, local_dir=local_dir))
    return stores


def run_lives(base: Path, run_id: str, local_dir: Path | None = None, *, check_base: bool = False,
              orphans: bool = False) -> list[tuple[Path, bool, list[Snapshot]]]:
    """Every slot directory of run ``run_id`` under ``base`` that ``local_dir`` reads (each rank's, each engine's,
    and the partner copies this node holds for other ranks, ``partner-of-rank-R``; ``orphans``: also those it
    answers for that no local_dir reads): its path, whether a live process holds it, and its committed snapshots
    (newest first)."""
    found = []
    for store in _stores(base, run_id, local_dir, check_base):
        lives = store._lives() + (store.orphans() if orphans and store.identity is not None else [])
        for life in sorted(set(lives)):
            found.append((life, not _unlocked(life), store.snapshots([life])))
    return found


def remove_stale(base: Path, run_id: str, local_dir: Path | None = None, *, check_base: bool = False,
                 dry_run: bool = False) -> list[Path]:
    """Remove (``dry_run``: only name) the slot directories of run ``run_id`` (``local_dir``'s, and those of earlier
    incarnations of it or that name none) that no live process holds, each oldest record first."""
    stale = [(life, snaps) for life, live, snaps in run_lives(base, run_id, local_dir, check_base=check_base,
                                                               orphans=True) if not live]
    if not dry_run:
        for life, snaps in stale:
            remove_life(life, [s.path for s in reversed(snaps)])
    return [life for life, _ in stale]
