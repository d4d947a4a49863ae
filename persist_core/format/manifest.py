"""The manifest: the one file that makes a directory a checkpoint.

It is written last. It names every shard file with its size and per-chunk crc32c, says which
file and entry holds each tensor of the state, and carries the state's tree (see
:mod:`persist_core.format.tree`). Readers check every file it names before trusting it.

Since format version 2 it ends with its own checksum, over the exact bytes before it::

    {"format":"torch-persist","version":2,...,"metadata":{}    ,"manifest_crc32c":1234567}
    |<---------------- crc32c of these bytes + "}" ---------->|

and nothing in it is trusted before that checks (a version 1 manifest has none and still loads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import crc32c

from persist_core.errors import CorruptCheckpointError
from persist_core.format.records import DIGESTS_VERSION, REFERENCES_VERSION, Chunk, TensorRecord, _whole
from persist_core.format.shard_file import FORMAT_NAME, FORMAT_VERSION

__all__ = ["Chunk", "FileEntry", "Manifest", "TensorRecord"]

_CHECKSUM_KEY = "manifest_crc32c"
_CHECKSUM_TAIL = re.compile(rb',"' + _CHECKSUM_KEY.encode() + rb'":(\d{1,10})\}$')
_FIRST_CHECKSUMMED_VERSION = 2
#: the newest format version this code reads (and writes, for a manifest with digests or lineage:
#: :attr:`Manifest.version`)
READ_VERSION = DIGESTS_VERSION


@dataclass(frozen=True)
class FileEntry:
    """One shard file: who wrote it, its size and a crc32c per ``chunk_bytes`` chunk."""

    name: str
    rank: int
    size: int
    checksum: str
    chunk_bytes: int
    chunks: tuple[int, ...]

    def blocks(self, start: int, end: int) -> tuple[int, int]:
        """The checksum blocks ``[first, stop)`` that hold bytes ``[start, end)`` of the file."""
        return start // self.chunk_bytes, -(-end // self.chunk_bytes)

    def spans(self, span_bytes: int) -> list[tuple[int, int]]:
        """The whole file as runs of checksum blocks ``[first, stop)`` of about ``span_bytes`` each
        (one ranged read each: a download with small blocks still makes large requests)."""
        per = max(1, span_bytes // self.chunk_bytes)
        n = len(self.chunks)
        return [(i, min(i + per, n)) for i in range(0, n, per)]

    def check(self, data: bytes | bytearray | memoryview, first: int, *, where: str) -> None:
        """Check ``data``, the bytes of blocks ``first, first + 1, ...``, against their checksums."""
        self.check_views([memoryview(data)], first, where=where)

    def check_views(self, views: list[memoryview], first: int, *, where: str) -> None:
        """Check the bytes of ``views`` (in order: blocks ``first, first + 1, ...``, whole blocks) against
        their checksums.

        Raises:
            CorruptCheckpointError: a block does not match, or the views do not end with a block.
        """
        size, cb = self.size, self.chunk_bytes
        i, crc = first, 0
        left = min(cb, size - i * cb) if i < len(self.chunks) else 0
        for view in views:
            view = memoryview(view).cast("B") if view.format != "B" else view
            while len(view):
                if left <= 0:
                    raise CorruptCheckpointError(f"{where}: bytes past the end of its {size}-byte file")
                n = min(len(view), left)
                crc = crc32c.crc32c(view[:n], crc)
                view, left = view[n:], left - n
                if left == 0:
                    if crc != self.chunks[i]:
                        raise CorruptCheckpointError(
                            f"{where}: chunk {i} (bytes {i * cb}..{min((i + 1) * cb, size)}) does not match its "
                            "checksum; the copy is corrupt: load another step, or restore this one from the other tier")
                    i, crc = i + 1, 0
                    left = min(cb, size - i * cb) if i < len(self.chunks) else 0
        if left != min(cb, size - i * cb) and i < len(self.chunks):
            raise CorruptCheckpointError(f"{where}: the bytes read end inside chunk {i}; the file is short or corrupt")


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, verify and rebuild one checkpoint.

    Attributes:
        step: the training step the user saved at.
        time: wall time (seconds since the epoch) of the save.
        world_size: how many ranks wrote files.
        tree: the JSON encoding of the state's structure.
        tensors: per tensor of the tree, its :class:`TensorRecord` (plain, or sharded: the chunks
            ranks wrote, which tile it).
        objects: per pickled leaf of the tree: ``[file, begin, length]`` in its ``__objects__`` entry.
        files: the shard files.
        metadata: the user's JSON-able metadata.
        per_rank: per rank that wrote, ``[file, begin, length]`` of each ``PerRank`` leaf (in tree
            order) in that file's ``__per_rank__`` entry (version 4).
        nodes: the ranks of each node whose ranks wrote into a ``local_dir`` of their own (version 5);
            empty when every rank wrote into one directory (one node, a shared file system).
        node: which of ``nodes`` this copy is (its directory holds that node's ranks' files only);
            ``None`` for a copy that holds every file (the remote's, one directory, a download).
        part: a memory snapshot of rank ``part``'s own state (several ranks, ``DTensor`` leaves): its sharded
            records hold that rank's boxes alone, so it loads into targets whose parts it holds, never whole;
            ``None`` (every checkpoint on disk): the chunks tile each sharded tensor.
        lineage: where this checkpoint comes from (version 7): ``run``, ``resumed_from`` (``{"step", "run"}`` or
            ``None`` for a fresh start), ``branch_from`` (the step a run that went back went back to, else ``None``),
            ``world_size``, ``versions`` (package -> version), ``git_commit`` (of the training code's checkout, or
            ``None``); the node layout is :attr:`nodes`, the user's metadata :attr:`metadata`. ``None``: older.
    """

    step: int
    time: float
    world_size: int
    tree: Any
    tensors: tuple[TensorRecord, ...]
    objects: tuple[tuple[str, int, int], ...]
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    per_rank: tuple[tuple[tuple[str, int, int], ...], ...] = ()
    nodes: tuple[tuple[int, ...], ...] = ()
    node: int | None = None
    part: int | None = None
    lineage: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        """Total bytes of the shard files."""
        return sum(f.size for f in self.files)

    def depends_on(self) -> set[int]:
        """The committed checkpoints whose files hold bytes of this one (its records' references; none before
        format version 6): retention keeps them while this one is kept."""
        return {step for t in self.tensors for step, _ in t.references()}

    def referenced_bytes(self) -> int:
        """Bytes of this checkpoint's tensors that the checkpoints it references hold (stored there once, shared;
        :attr:`nbytes` is what it holds itself): per referenced entry, the extent its records cover."""
        from persist_core.format.shard_file import dtype_from_name, itemsize

        extent: dict[tuple[int, str | None, str | None], int] = {}
        for t in self.tensors:
            if t.step is None or t.chunks is not None:
                continue
            if 0 in t.shape:
                continue
            span = math.prod(t.shape) if t.stride is None else 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride))
            key = (t.step, t.file, t.entry)
            extent[key] = max(extent.get(key, 0), t.offset + span * itemsize(dtype_from_name(t.dtype)))
        return sum(extent.values())

    @property
    def version(self) -> int:
        """The format version this manifest is written as: 7 with leaf digests or lineage (resume verification), 6
        when it references another checkpoint's bytes, else 5 (older readers load it)."""
        if self.lineage is not None or any(t.digest is not None for t in self.tensors):
            return DIGESTS_VERSION
        return REFERENCES_VERSION if self.depends_on() else FORMAT_VERSION

    def held(self) -> tuple[FileEntry, ...]:
        """The files this copy holds: every file, or (a node's copy) those its node's ranks wrote."""
        if self.node is None:
            return self.files
        ranks = set(self.nodes[self.node])
        return tuple(f for f in self.files if f.rank in ranks)

    def elsewhere(self) -> tuple[FileEntry, ...]:
        """The files of the checkpoint that this copy does not hold (other nodes hold them, and the remote)."""
        held = set(self.held())
        return tuple(f for f in self.files if f not in held)

    def placed(self, node: int | None) -> Manifest:
        """This manifest as the copy of ``node`` writes it (``None``: the copy holding every file)."""
        return replace(self, node=node)

    def to_bytes(self) -> bytes:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["tensors"] = [t.to_json() for t in self.tensors]
        fields["files"] = [asdict(f) for f in self.files]
        if self.part is None:  # only a rank's memory snapshot has it
            del fields["part"]
        if self.lineage is None:  # version 7 on
            del fields["lineage"]
        body = json.dumps({"format": FORMAT_NAME, "version": self.version, **fields}, separators=(",", ":")).encode()
        return body[:-1] + f',"{_CHECKSUM_KEY}":{crc32c.crc32c(body)}}}'.encode()

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
            body = json.loads(_checked(raw, where=where))
            if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
                raise CorruptCheckpointError(f"{where} is not a torch-persist manifest")
            version = body.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise CorruptCheckpointError(f"{where} has no valid format version ({version!r})")
            if version > READ_VERSION:
                raise CorruptCheckpointError(
                    f"{where} has format version {version}; this torch-persist reads versions up to "
                    f"{READ_VERSION}: upgrade torch-persist to load it"
                )
            if (_CHECKSUM_KEY in body) != (version >= _FIRST_CHECKSUMMED_VERSION):
                raise CorruptCheckpointError(f"{where}: a version {version} manifest "
                                             f"{'without' if version >= 2 else 'with'} a checksum is corrupt")
            manifest = cls(
                step=int(body["step"]),
                time=float(body["time"]),
                world_size=int(body["world_size"]),
                tree=body["tree"],
                tensors=tuple(TensorRecord.parse(r, i, where, version, part=body.get("part") is not None)
                              for i, r in enumerate(body["tensors"])),
                objects=tuple((str(f), int(b), int(n)) for f, b, n in body["objects"]),
                files=tuple(FileEntry(**{**f, "chunks": tuple(f["chunks"])}) for f in body["files"]),
                metadata=dict(body.get("metadata") or {}),
                per_rank=tuple(tuple((str(f), int(b), int(n)) for f, b, n in r) for r in body.get("per_rank", ())),
                nodes=tuple(tuple(n) for n in body.get("nodes", ())),
                node=body.get("node"),
                part=body.get("part"),
                lineage=body.get("lineage"),
            )
            _check_places(manifest, where)
            _check_schema(manifest, where)
            return manifest
        except CorruptCheckpointError:
            raise
        except Exception as e:  # whatever a damaged manifest makes the parser raise, it is corrupt
            raise CorruptCheckpointError(f"{where} is not a valid manifest: {type(e).__name__}: {e}") from e


def _check_places(m: Manifest, where: str) -> None:
    """Every file a manifest names is a shard name of ``layout.py``'s grammar, listed once, with sane numbers,
    and every record places its bytes in a listed file: a crafted name (``../x``, ``/etc/passwd``) never
    makes a reader open, or a download create, a file outside the checkpoint."""
    from persist_core.layout import parse_shard_filename

    names = set()
    for f in m.files:
        if parse_shard_filename(f.name) is None:
            raise CorruptCheckpointError(f"{where} names a file {str(f.name)[:80]!r}, not a shard name "
                                         "(rank-NNNNN.safetensors or .ckpt): the manifest is corrupt or crafted")
        if f.name in names:
            raise CorruptCheckpointError(f"{where} lists {f.name!r} twice")
        names.add(f.name)
        numbers = (f.rank, f.size, f.chunk_bytes)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in numbers) or f.chunk_bytes == 0 \
                or len(f.chunks) != -(-f.size // f.chunk_bytes) \
                or any(not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < 1 << 32 for c in f.chunks):
            raise CorruptCheckpointError(f"{where}: its entry for {f.name!r} has impossible sizes or checksums")
    placed = [fname for fname, _, _ in m.objects] + [fname for rank in m.per_rank for fname, _, _ in rank]
    for rec in m.tensors:
        placed += rec.files()
    stray = [p for p in placed if p not in names]
    for rec in m.tensors:  # another checkpoint's file: a shard name, of an older step (never a cycle)
        for step, fname in rec.references():
            if parse_shard_filename(fname) is None or step >= m.step:
                raise CorruptCheckpointError(f"{where} references {str(fname)[:80]!r} of step {step}: not an older "
                                             "checkpoint's shard; the manifest is corrupt or crafted")
    if stray:
        raise CorruptCheckpointError(f"{where} places bytes in {str(stray[0])[:80]!r}, a file it does not list: "
                                     "the manifest is corrupt or crafted")


def _check_schema(m: Manifest, where: str) -> None:
    """Every field a reader uses has the type and range it must (a crafted manifest carrying its own
    checksum is corrupt here, by name, instead of crashing a reader with a raw error or loading wrong
    values); the tree is walked without recursion, whatever its depth."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {what}; the manifest is corrupt or crafted")

    if not _whole(m.step) or not _whole(m.world_size, 1):
        raise bad(f"step={m.step!r} / world_size={m.world_size!r} out of range")
    if m.nodes and sorted(r for n in m.nodes for r in n) != list(range(m.world_size)) \
            or any(not _whole(r) for n in m.nodes for r in n):
        raise bad(f"nodes={str(m.nodes)[:80]} do not split its {m.world_size} ranks")
    if m.node is not None and (not _whole(m.node) or m.node >= len(m.nodes)):
        raise bad(f"node={m.node!r} is not one of its {len(m.nodes)} nodes")
    if m.part is not None and not _whole(m.part):
        raise bad(f"part={m.part!r} is not a rank")
    if m.lineage is not None and not isinstance(m.lineage, dict):
        raise bad(f"lineage is {type(m.lineage).__name__}, not an object")
    if m.per_rank and len(m.per_rank) != m.world_size:
        raise bad(f"per_rank lists {len(m.per_rank)} ranks for a world of {m.world_size}")
    for fname, begin, length in [*m.objects, *(p for r in m.per_rank for p in r)]:
        if begin < 0 or length < 0:
            raise bad(f"a pickled leaf at bytes {begin}..{begin + length} of {fname!r}")
    seen_tensors: set[int] = set()
    stack = [m.tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or not node:
            raise bad(f"a tree node is {type(node).__name__} {str(node)[:40]!r}")
        kind = next(iter(node))
        if kind == "tensor":
            i = node["tensor"]
            if not _whole(i) or i >= len(m.tensors) or i in seen_tensors:
                raise bad(f"a tree node names tensor {i!r} (the manifest has {len(m.tensors)}, each named once)")
            seen_tensors.add(i)
        elif kind == "object":
            if not _whole(node["object"]) or node["object"] >= len(m.objects):
                raise bad(f"a tree node names pickled leaf {node['object']!r} of {len(m.objects)}")
        elif kind == "per_rank":
            counts = {len(r) for r in m.per_rank} or {0}
            if not _whole(node["per_rank"]) or node["per_rank"] >= min(counts):
                raise bad(f"a tree node names PerRank value {node['per_rank']!r} that the ranks did not all save")
        elif kind == "value":
            if node["value"] is not None and not isinstance(node["value"], (bool, int, float, str)):
                raise bad(f"a tree value is {type(node['value']).__name__}")
        elif kind == "dict":
            pairs = node["dict"]
            if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) != 2 for p in pairs):
                raise bad("a dict node's items are not [key, value] pairs")
            stack.extend(x for p in pairs for x in p)
        elif kind in ("list", "tuple"):
            if not isinstance(node[kind], list):
                raise bad(f"a {kind} node holds {type(node[kind]).__name__}")
            stack.extend(node[kind])
        else:
            raise bad(f"a tree node of unknown kind {kind!r}")
    if len(seen_tensors) != len(m.tensors):
        raise bad(f"the tree names {len(seen_tensors)} of its {len(m.tensors)} tensor records")


def _checked(raw: bytes, *, where: str) -> bytes:
    """``raw`` when its checksum matches (or it has none: version 1, checked by the caller)."""
    tail = _CHECKSUM_TAIL.search(raw)
    if tail is None:
        if f'"{_CHECKSUM_KEY}"'.encode() in raw:
            raise CorruptCheckpointError(f"{where}: its checksum field is damaged; the manifest is corrupt")
        return raw
    body = raw[: tail.start()] + b"}"
    if crc32c.crc32c(body) != int(tail.group(1)):
        raise CorruptCheckpointError(
            f"{where} does not match its own checksum: the manifest is corrupt (this checkpoint is skipped; "
            "restore it from the other tier, or delete it)")
    return raw
