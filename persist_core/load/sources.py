"""The sources a load is given rather than makes: the memory tier's snapshots (a
:class:`~persist_core.tiers.tier.HostReader`, the :class:`~persist_core.memory.store.MemoryStore`: the load reads
memory as one more source, each slot a copy of its own; :class:`MemoryOption`, the user's
:class:`~persist_core.MemoryTier` that opens it) and a partner's copy pulled back for one load (:class:`Pulled`).
Each copy of a step such a source holds is read alike, newest first (:func:`read_copies`); what a load asks of it
beyond reading — the steps a whole load can read, the newest, the step a copy's path names — is asked of its
listing (:func:`held_steps`, :func:`newest`, :func:`step_at`).

The load flow knows them by these protocols only: the memory tier is a flow of its own (:mod:`persist_core.memory`),
which the load flow never imports.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from persist_core.assembly.assemble import read_copy
from persist_core.assembly.blocks import LoadStats
from persist_core.assembly.plan import LoadOptions
from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.tiers.tier import CheckpointInfo, HostReader, TierReader

log = logging.getLogger(__name__)


@runtime_checkable
class MemoryOption(Protocol):
    """The ``memory`` option a user passes (:class:`~persist_core.MemoryTier`): the snapshots of the run
    ``local_dir`` keeps the id of."""

    def reads(self, local_dir: Path) -> HostReader | None: ...


class Pulled(Protocol):
    """A partner's copy pulled back for one load (:func:`~persist_core.load.agree.agreed_load`): read as any copy
    on this host is, then discarded."""

    @property
    def step(self) -> int: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def copy(self) -> HostReader: ...

    def discard(self) -> None: ...


def held_steps(source: TierReader, *, whole: bool = False) -> set[int]:
    """The steps ``source`` holds; ``whole``: those a whole load can read (a rank's part of sharded tensors, a
    manifest with ``part``, loads into targets only)."""
    steps = set(source.committed_steps())
    if not whole:
        return steps
    return {step for step in steps if _whole(source, step)}


def _whole(source: TierReader, step: int) -> bool:
    try:
        return source.read_manifest(step).part is None
    except (CheckpointNotFoundError, CorruptCheckpointError):  # gone since it was listed, or unreadable: not held
        return False


def newest(source: TierReader, *, newer_than: int) -> CheckpointInfo | None:
    """The newest copy ``source`` lists that a whole load can read (its ``path`` as :func:`step_at` understands it),
    when its step is newer than ``newer_than``; else ``None``."""
    listed = source.list()  # oldest first
    whole = held_steps(source, whole=True) if listed and listed[-1].step > newer_than else set()
    found = next((info for info in reversed(listed) if info.step in whole), None)
    return found if found is not None and found.step > newer_than else None


def step_at(source: TierReader, path: str | os.PathLike[str]) -> int | None:
    """The step of the copy of ``source`` whose ``path`` (as :meth:`~persist_core.tiers.tier.TierReader.list` gives
    it) is ``path``, or ``None``."""
    real = os.path.realpath(path)
    return next((info.step for info in source.list() if os.path.realpath(info.path) == real), None)


def read_copies(copies: Sequence[HostReader], step: int, into: Any, *, what: str, options: LoadOptions,
                pool: Executor, stats: LoadStats) -> tuple[Any, Manifest]:
    """``(the state, its manifest)`` of ``step`` from the first of ``copies`` (newest first) whose bytes verify
    (:func:`~persist_core.assembly.assemble.read_copy`); ``what`` names them in messages.

    Raises:
        CorruptCheckpointError: no copy verifies (the last one's failure), or there is none left.
    """
    for i, copy in enumerate(copies):
        try:
            manifest = copy.read_manifest(step)
            return read_copy(copy, step, manifest, into, options=options, pool=pool, stats=stats,
                             where=copy.location), manifest
        except CorruptCheckpointError:
            if i + 1 == len(copies):
                raise
            log.warning("[step=%d] the %s copy %s does not verify; trying an older copy", step, what, copy.location)
    raise CorruptCheckpointError(f"no {what} copy of step={step} is left")
