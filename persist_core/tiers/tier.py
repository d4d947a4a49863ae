"""The ``Tier`` protocols: one place committed checkpoints live, and what it reports of them.

:class:`TierReader` is the read side (``committed_steps``, ``list``, ``read_manifest``, ``read_blocks``): the memory
tier's :class:`~persist_core.memory.store.MemoryStore` offers it, and so do the disk and the remote.
:class:`HostReader` adds what a read of files on this host has: ``open_file`` (a whole load reads each file as
saved, so tensors that shared storage share it again) and ``copies`` (each copy of a step as a reader of its own,
newest first, so one that does not verify passes the load to the next): the local tier and the memory tier's store.
:class:`Tier` adds what only checkpoints have (``verify``, ``remove``): the local and the remote tiers. So what
prunes or checks checkpoints, which takes a ``Tier``, never takes memory snapshots for checkpoints.

Who calls what: the engine's :class:`~persist_core.policies.retention.Retainer` calls ``list`` and
``remove`` after each commit (one retention loop for every tier); the
:class:`~persist_core.load.reader.CheckpointReader` calls ``committed_steps``, ``read_manifest`` and
``read_blocks`` (of a :class:`HostReader`, ``copies`` and ``open_file`` too; bytes only: what they mean is
:mod:`persist_core.load`'s);
the ``persist`` command calls all of them. A tier never decides what to keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from persist_core.format.manifest import FileEntry, Manifest


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as :meth:`CheckpointEngine.list` reports it."""

    step: int
    time: float
    nbytes: int
    path: str
    tier: str = "local"


@runtime_checkable
class TierReader(Protocol):
    """The read side: what one location holds, read (a local directory, a remote URL, the memory tier's slots).

    ``kind`` is ``"local"``, ``"remote"`` or ``"memory"``; ``location`` names it in messages.
    """

    kind: str

    @property
    def location(self) -> str: ...

    def committed_steps(self) -> list[int]:
        """Steps that hold a manifest, ascending (nothing verified)."""
        ...

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, every file it places on this tier checked for presence and size."""
        ...

    def read_blocks(self, step: int, f: FileEntry, first: int, views: list[memoryview], *, verify: bool = True) -> None:
        """Fill ``views`` (in file order) with whole checksum blocks of file ``f`` of ``step`` from block
        ``first`` on, each verified unless ``verify`` is off."""
        ...

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest and file sizes check, oldest first."""
        ...


class WholeFile(Protocol):
    """One file of a copy open for a whole read (:class:`~persist_core.tiers.local.ShardFile`): what
    :func:`~persist_core.assembly.blocks.read_shard` takes. A context manager: leaving it closes the file."""

    path: Path

    def __enter__(self) -> WholeFile: ...

    def __exit__(self, *exc: object) -> None: ...

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes of the file."""
        ...

    def fill(self, blocks: list[tuple[list[memoryview], int, int | None, int]]) -> None:
        """Read a run of checksum blocks, each ``(views in file order, file offset, expected crc32c or None, block
        index)``, verifying those that carry a checksum."""
        ...


@runtime_checkable
class HostReader(TierReader, Protocol):
    """The read side of a tier whose files lie on this host (the local directory, the memory tier's slots).

    ``kind`` ``"memory"``: each copy is its rank's own one-rank image (whichever rank reads it gets the ``PerRank``
    values it holds).
    """

    def open_file(self, step: int, f: FileEntry) -> WholeFile:
        """File ``f`` of ``step`` open for a whole read, its size checked against ``f``.

        Raises:
            CorruptCheckpointError: the file is short of what ``f`` says (or, for a copy that is never longer than
                its record, of another size); a memory copy that cannot be opened.
        """
        ...

    def copies(self, step: int) -> Sequence[HostReader]:
        """Each copy of ``step`` held here as a reader of that copy alone, newest first (a local directory holds
        one; the memory tier one per slot that holds the step)."""
        ...


@runtime_checkable
class Tier(TierReader, Protocol):
    """Committed checkpoints under one location (a local directory, or a remote URL): the read side, and what only
    checkpoints have (each verified whole, removed by retention).

    ``kind`` is ``"local"`` or ``"remote"``.
    """

    def verify(self, step: int, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every byte of ``step`` and check its checksums; the problems found."""
        ...

    def remove(self, step: int) -> None:
        """Delete ``step``: its manifest first, so a crash part-way leaves no checkpoint."""
        ...
