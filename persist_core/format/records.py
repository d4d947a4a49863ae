"""The manifest's tensor records, typed: :class:`TensorRecord` (where one tensor of the state is) and :class:`Chunk`
(one box of a sharded tensor). Parsed and checked once, when a manifest is read (:meth:`TensorRecord.parse`); written
back as the same JSON, key for key (:meth:`TensorRecord.to_json`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from persist_core.errors import CorruptCheckpointError


def _whole(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and all(_whole(x) for x in v) and (n is None or len(v) == n)


#: the first format version whose chunks may name bytes in another checkpoint (incremental saves, issue 43)
REFERENCES_VERSION = 6

#: the first format version whose plain tensor records carry ``digest`` (resume verification, issue 55) and whose
#: manifest carries ``lineage``
DIGESTS_VERSION = 7

_HASH = re.compile(r"[0-9a-f]{32}")  # xxh3-128 of a tensor's bytes, hex (incremental saves)


@dataclass(frozen=True)
class Chunk:
    """One box of a sharded tensor that some rank wrote, C-contiguous in entry ``entry`` of ``file`` (version 4).

    ``step``: the committed checkpoint of this run whose ``file`` holds the bytes (a reference, from format
    version 6 on: incremental saves write what did not change once); ``None``: this checkpoint's own file.
    ``hash``: the xxh3-128 (hex) of the chunk's bytes (incremental saves; a reference always has one).
    """

    file: str
    entry: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    step: int | None = None
    hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "entry": self.entry, "offsets": list(self.offsets), "sizes": list(self.sizes)}
        if self.step is not None:
            out["step"] = self.step
        if self.hash is not None:
            out["hash"] = self.hash
        return out


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor of the state is.

    A plain tensor (``chunks is None``): bytes from ``offset`` of entry ``entry`` of ``file``, laid out by ``stride``
    (``None``: C-contiguous); ``replicated``: every rank held the same value (``None`` in manifests before it was
    recorded). A sharded tensor (version 4): its global ``shape``, ``placements`` and ``mesh``, and the ``chunks``
    ranks wrote, which tile it.

    Incremental saves (format version 6): ``hash``, the xxh3-128 (hex) of the bytes of the entry holding it, and
    ``step``: the committed checkpoint of this run whose ``file`` holds them (a reference: ``entry`` and ``offset``
    are that file's; always the checkpoint holding the bytes, never one that references them in turn); ``None``:
    this checkpoint's own file. A record with a hash and no step is readable by version-5 code.

    Resume verification (format version 7): ``digest``, the xxh3-128 (hex) of the tensor's elements in C order (the
    bytes ``t.contiguous()`` holds), computed on the writer thread from the staged bytes; ``None``: not recorded
    (older versions, a sharded tensor).
    """

    dtype: str
    shape: tuple[int, ...]
    file: str | None = None
    entry: str | None = None
    stride: tuple[int, ...] | None = None
    offset: int = 0
    replicated: bool | None = None
    placements: Any = None
    mesh: tuple[int, ...] | None = None
    chunks: tuple[Chunk, ...] | None = None
    step: int | None = None
    hash: str | None = None
    digest: str | None = None

    @property
    def sharded(self) -> bool:
        return self.chunks is not None

    def files(self) -> list[str]:
        """The files of this checkpoint this record places bytes in (not those of the checkpoints it references)."""
        if self.chunks is not None:
            return [c.file for c in self.chunks if c.step is None]
        return [] if self.step is not None else [self.file]  # type: ignore[list-item]

    def references(self) -> list[tuple[int, str]]:
        """``(step, file)`` of each other checkpoint's file this record names bytes in."""
        if self.chunks is not None:
            return [(c.step, c.file) for c in self.chunks if c.step is not None]
        return [] if self.step is None else [(self.step, self.file)]  # type: ignore[list-item]

    def to_json(self) -> dict[str, Any]:
        if self.chunks is not None:
            return {"dtype": self.dtype, "shape": list(self.shape), "placements": self.placements,
                    "mesh": None if self.mesh is None else list(self.mesh), "chunks": [c.to_json() for c in self.chunks]}
        out = {"file": self.file, "entry": self.entry, "dtype": self.dtype, "shape": list(self.shape),
               "stride": None if self.stride is None else list(self.stride), "offset": self.offset}
        if self.replicated is not None:
            out["replicated"] = self.replicated
        if self.step is not None:
            out["step"] = self.step
        if self.hash is not None:
            out["hash"] = self.hash
        if self.digest is not None:
            out["digest"] = self.digest
        return out

    @classmethod
    def parse(cls, raw: Any, i: int, where: str, version: int = REFERENCES_VERSION - 1, *,
              part: bool = False) -> TensorRecord:
        """Record ``i`` of the manifest read from ``where``, every field of the type and range a reader needs
        (``part``: a rank's memory snapshot, whose sharded records may hold that rank's boxes alone).

        Raises:
            CorruptCheckpointError: a field a reader uses is missing, of another type, or out of range (a crafted
                manifest carrying its own checksum is corrupt here, by name).
        """
        from persist_core.format.shard_file import dtype_from_name, itemsize

        def bad(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: {what}; the manifest is corrupt or crafted")

        if not isinstance(raw, dict):
            raise CorruptCheckpointError(f"{where}: a tensor record is {type(raw).__name__}, not an object")
        try:
            dtype = dtype_from_name(raw["dtype"])
        except (KeyError, TypeError):
            raise bad(f"tensor record {i} has no valid dtype") from None
        shape = raw.get("shape")
        if not _ints(shape):
            raise bad(f"tensor record {i} has shape {shape!r}")
        if "chunks" in raw:
            chunks = _chunks(raw["chunks"], i, shape, bad, version, part=part)
            mesh = raw.get("mesh")
            return cls(dtype=raw["dtype"], shape=tuple(shape), placements=raw.get("placements"),
                       mesh=None if mesh is None else tuple(mesh), chunks=chunks)
        entry, offset, stride = raw.get("entry"), raw.get("offset", 0), raw.get("stride")
        if not isinstance(entry, str) or not _whole(offset):
            raise bad(f"tensor record {i} has entry {entry!r} / offset {offset!r}")
        if stride is not None and not _ints(stride, len(shape)):
            raise bad(f"tensor record {i} has stride {stride!r} for shape {shape}")
        size = itemsize(dtype)
        if offset % size:
            raise bad(f"tensor record {i}'s offset {offset} is not a multiple of its {size}-byte elements")
        step, digest = raw.get("step"), raw.get("hash")
        if step is not None and (version < REFERENCES_VERSION or not _whole(step)):
            raise bad(f"tensor record {i} names step {step!r}: references to another checkpoint's bytes are format "
                      f"version {REFERENCES_VERSION} on, this manifest is {version}")
        if digest is not None and not (isinstance(digest, str) and _HASH.fullmatch(digest)):
            raise bad(f"tensor record {i} has hash {str(digest)[:40]!r}, not 32 hex digits")
        if step is not None and digest is None:
            raise bad(f"tensor record {i} references step {step} without the hash of its bytes")
        leaf = raw.get("digest")
        if leaf is not None and (version < DIGESTS_VERSION or not (isinstance(leaf, str) and _HASH.fullmatch(leaf))):
            raise bad(f"tensor record {i} has digest {str(leaf)[:40]!r}: 32 hex digits, format version "
                      f"{DIGESTS_VERSION} on (this manifest is {version})")
        return cls(dtype=raw["dtype"], shape=tuple(shape), file=raw.get("file"), entry=entry,
                   stride=None if stride is None else tuple(stride), offset=offset, replicated=raw.get("replicated"),
                   step=step, hash=digest, digest=leaf)


def _chunks(raw: Any, i: int, shape: list[int], bad: Any, version: int, *, part: bool = False) -> tuple[Chunk, ...]:
    chunks = []
    for c in raw if isinstance(raw, list) else [None]:
        if not isinstance(c, dict) or not isinstance(c.get("entry"), str) or not _ints(c.get("offsets"), len(shape)) \
                or not _ints(c.get("sizes"), len(shape)) \
                or any(o + n > d for o, n, d in zip(c["offsets"], c["sizes"], shape)):
            raise bad(f"sharded tensor record {i} has a chunk {str(c)[:80]} outside its shape {shape}")
        step, digest = c.get("step"), c.get("hash")
        if step is not None and (version < REFERENCES_VERSION or not _whole(step)):
            raise bad(f"sharded tensor record {i} has a chunk naming step {step!r}: references to another "
                      f"checkpoint's bytes are format version {REFERENCES_VERSION} on, this manifest is {version}")
        if digest is not None and not (isinstance(digest, str) and _HASH.fullmatch(digest)):
            raise bad(f"sharded tensor record {i} has a chunk with hash {str(digest)[:40]!r}, not 32 hex digits")
        if step is not None and digest is None:
            raise bad(f"sharded tensor record {i} has a chunk referencing step {step} without the hash of its bytes")
        chunks.append(Chunk(file=c.get("file"), entry=c["entry"], offsets=tuple(c["offsets"]), sizes=tuple(c["sizes"]),
                            step=step, hash=digest))
    boxes = [(c.offsets, c.sizes) for c in chunks]
    if sum(math.prod(n) for _, n in boxes) != math.prod(shape) and not part:
        raise bad(f"sharded tensor record {i}'s chunks do not cover its {math.prod(shape)} elements")
    for a in range(len(boxes)):  # equal total and no overlap: they tile it
        for b in range(a + 1, len(boxes)):
            (oa, na), (ob, nb) = boxes[a], boxes[b]
            if all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(oa, na, ob, nb)) and math.prod(na) \
                    and math.prod(nb):
                raise bad(f"sharded tensor record {i} has overlapping chunks")
    return tuple(chunks)
