"""The manifest (format version 1): the one file that makes a directory a checkpoint.

It is written last. It names every shard file with its size and per-chunk crc32c, says which
file and entry holds each tensor of the state, and carries the state's tree (see
:mod:`persist_core.format.tree`). Readers check every file it names before trusting it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from persist_core.errors import CorruptCheckpointError
from persist_core.format.shard_file import FORMAT_NAME, FORMAT_VERSION


@dataclass(frozen=True)
class FileEntry:
    """One shard file: who wrote it, its size and a crc32c per ``chunk_bytes`` chunk."""

    name: str
    rank: int
    size: int
    checksum: str
    chunk_bytes: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, verify and rebuild one checkpoint.

    Attributes:
        step: the training step the user saved at.
        time: wall time (seconds since the epoch) of the save.
        world_size: how many ranks wrote files.
        tree: the JSON encoding of the state's structure.
        tensors: per tensor of the tree: ``file``, ``entry``, ``dtype``, ``shape``, ``stride``,
            ``offset`` and ``replicated`` (whether every rank held the same value).
        objects: per pickled leaf of the tree: ``[file, begin, length]`` in its ``__objects__`` entry.
        files: the shard files.
        metadata: the user's JSON-able metadata.
    """

    step: int
    time: float
    world_size: int
    tree: Any
    tensors: tuple[dict[str, Any], ...]
    objects: tuple[tuple[str, int, int], ...]
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Total bytes of the shard files."""
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(self)}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str, step: int | None = None) -> Manifest:
        """Parse a manifest read from ``where``; ``step``: the step its directory's name says.

        Raises:
            CorruptCheckpointError: not JSON, another format, a newer version, missing fields, or a
                step other than its directory's (a flipped bit must never make it a write target).
        """
        manifest = cls._parse(raw, where=where)
        if step is not None and manifest.step != step:
            raise CorruptCheckpointError(
                f"{where} says step {manifest.step} but its directory is step {step}: the manifest is corrupt "
                "(this checkpoint is skipped; restore it from the other tier, or delete it)")
        return manifest

    @classmethod
    def _parse(cls, raw: bytes, *, where: str) -> Manifest:
        try:
            body = json.loads(raw)
            if body.get("format") != FORMAT_NAME:
                raise CorruptCheckpointError(f"{where} is not a torch-persist manifest (format={body.get('format')!r})")
            if body.get("version") != FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"{where} has format version {body.get('version')!r}; this torch-persist reads version "
                    f"{FORMAT_VERSION}: upgrade torch-persist to load it"
                )
            return cls(
                step=int(body["step"]),
                time=float(body["time"]),
                world_size=int(body["world_size"]),
                tree=body["tree"],
                tensors=tuple(body["tensors"]),
                objects=tuple((str(f), int(b), int(n)) for f, b, n in body["objects"]),
                files=tuple(FileEntry(**{**f, "chunks": tuple(f["chunks"])}) for f in body["files"]),
                metadata=dict(body.get("metadata") or {}),
            )
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where} is not a valid manifest: {type(e).__name__}: {e}") from e
