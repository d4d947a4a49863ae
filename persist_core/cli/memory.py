"""The memory tier in the ``persist`` command: ``ls`` lists a local directory's run's snapshots in memory (kind
``memory``: its ranks' own; ``memory-partner``: the copies this node holds for another node's ranks), ``gc
--memory`` removes those no live process holds (a run killed for good leaves them in ``/dev/shm``), and those of an
earlier incarnation of the directory (erased and made again) or that name none, which no restart reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from persist_core.layout import is_url, parse_partner_dirname
from persist_core.run_ids import run_id_of
from persist_core.memory.runs import remove_stale, run_lives
from persist_core.memory.files import default_base


def _run_id(location: str) -> str | None:
    """The id of the stopped run ``location`` (a local directory) holds: the one kept there first."""
    return None if is_url(location) else run_id_of(Path(location.removeprefix("file://")), stopped=True)


def memory_rows(location: str, memory_dir: str | None) -> list[dict[str, Any]]:
    """``ls`` rows for the memory snapshots of the run ``location`` (a local directory) keeps the id of."""
    run_id = _run_id(location)
    if run_id is None:
        return []
    rows = []
    local_dir = Path(location.removeprefix("file://"))
    for life, live, snaps in run_lives(_base(memory_dir), run_id, local_dir, check_base=memory_dir is None):
        of_rank = parse_partner_dirname(life.parent.name)
        for s in snaps:
            rows.append({"step": s.step, "kind": "memory" if of_rank is None else "memory-partner",
                         "time": s.manifest.time, "bytes": s.manifest.nbytes, "files": 1,
                         "ranks": None if of_rank is None else [of_rank], "path": str(s.path), "milestone": False,
                         "abandoned": False, "process": "live" if live else "stopped"})
    return rows


def remove_stale_memory(location: str, memory_dir: str | None, *, dry_run: bool) -> list[str]:
    """``gc --memory``: the slot directories of ``location``'s run that no live process holds, removed."""
    run_id = _run_id(location)
    if run_id is None:
        return []
    return [str(p) for p in remove_stale(_base(memory_dir), run_id, Path(location.removeprefix("file://")),
                                         check_base=memory_dir is None, dry_run=dry_run)]


def _base(memory_dir: str | None) -> Path:
    return default_base() if memory_dir is None else Path(os.path.expanduser(memory_dir))
