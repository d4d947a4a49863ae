"""The sources a load is given rather than makes: the memory tier's snapshots (:class:`MemorySource`, what
:class:`~persist_core.memory.read.SnapshotReads` offers; :class:`MemoryOption`, the user's
:class:`~persist_core.MemoryTier` that makes one) and a partner's copy pulled back for one load (:class:`Pulled`).

The load flow knows them by these protocols only: the memory tier is a flow of its own (:mod:`persist_core.memory`),
which the load flow never imports.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from persist_core.assembly.blocks import LoadStats
from persist_core.assembly.plan import LoadOptions
from persist_core.format.manifest import Manifest
from persist_core.tiers.tier import CheckpointInfo


@runtime_checkable
class MemorySource(Protocol):
    """One rank's memory snapshots, as a load reads them."""

    def steps(self, *, whole: bool = False) -> set[int]:
        """The steps held; ``whole``: those a whole load can read."""
        ...

    def latest(self, *, newer_than: int) -> CheckpointInfo | None:
        """The newest snapshot (``tier="memory"``, ``path`` its slot) when newer than ``newer_than``."""
        ...

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        """The step of the snapshot whose slot ``path`` names, or ``None``."""
        ...

    def read(self, step: int, into: Any, *, options: LoadOptions, pool: Executor,
             stats: LoadStats) -> tuple[Any, Manifest]:
        """``(the state, its manifest)`` of ``step``, every byte verified (``CorruptCheckpointError`` if none does)."""
        ...


@runtime_checkable
class MemoryOption(Protocol):
    """The ``memory`` option a user passes (:class:`~persist_core.MemoryTier`): the snapshots of the run
    ``local_dir`` keeps the id of."""

    def reads(self, local_dir: Path) -> MemorySource | None: ...


class Pulled(Protocol):
    """A partner's copy pulled back for one load (:func:`~persist_core.load.agree.agreed_load`)."""

    @property
    def step(self) -> int: ...

    @property
    def manifest(self) -> Manifest: ...

    def read(self, into: Any, *, options: LoadOptions, pool: Executor, stats: LoadStats) -> Any: ...

    def discard(self) -> None: ...
