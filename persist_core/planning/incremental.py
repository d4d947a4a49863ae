"""Incremental saves, decided without I/O (issue 43): which tensors of a staged shard reference the bytes of the
newest committed checkpoint instead of being written again, and the layout of the shard without them.

Who calls what: the writer thread (:class:`~persist_core.save.dedup.Incremental`) hashes each whole-entry tensor of
the staged shard, then calls :func:`reference_unchanged` with the newest committed manifest, then :func:`compact`
for the header and the moves that leave only the changed entries in the staging buffer. Before the copy, the saver's
:meth:`~persist_core.save.dedup.Incremental.before_copy` calls :func:`unchanged_before_copy` with the hashes of host
tensors hashed where they lie: those entries are never staged, and the writer references them (``known``). Pure: no
I/O.

Rules: an entry of plain tensors (one alone in its storage, or several sharing one: tied weights, views) is
referenced when the previous checkpoint's entry of the same name holds the same tensors (dtype, shape, stride,
offset) and the same bytes (its 128-bit content hash); a sharded tensor's chunk, when the same record of the previous
checkpoint has a chunk of the same box with the same hash; pickled leaves are always written. A reference names the checkpoint that physically holds the
bytes (the previous one's reference is followed once: depth 1). A save is full when it is the first, when the last
full one is ``full_every`` saves back, or when its references would name more than ``max_span`` checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from persist_core._knobs import ENTRY_ALIGN_BYTES, PAGE_BYTES
from persist_core.format.manifest import Manifest
from persist_core.format.records import TensorRecord
from persist_core.format.shard_file import encode_header
from persist_core.format.torch_zip import HEADER_RECORD, Record, header_record, zip_tail
from persist_core.planning.torch_loadable import TAIL_ENTRY


def hashable(rec: TensorRecord | None) -> bool:
    """Whether ``rec``'s bytes are in an entry of this checkpoint's own file that holds plain tensors only (one alone,
    or several sharing a storage): the entries a save may reference."""
    return rec is not None and rec.chunks is None and rec.step is None and rec.entry is not None


def hashed_entries(records: Sequence[TensorRecord | None]) -> set[str]:
    """The entries of this checkpoint's own file whose bytes a save hashes: the plain tensors' (:func:`hashable`)
    and each sharded tensor's own chunks' (one chunk an entry)."""
    out: set[str] = set()
    for r in records:
        if hashable(r):
            out.add(r.entry)  # type: ignore[union-attr,arg-type]
        elif r is not None and r.chunks is not None:
            out.update(c.entry for c in r.chunks if c.step is None)
    return out


def _hashed(r: TensorRecord | None, hashes: Mapping[str, str]) -> TensorRecord | None:
    """``r`` with the hash of each of its own entries (a plain tensor's, or each own chunk's)."""
    if hashable(r) and r.entry in hashes:  # type: ignore[union-attr]
        return dataclasses.replace(r, hash=hashes[r.entry])  # type: ignore[arg-type,index]
    if r is not None and r.chunks is not None:
        return dataclasses.replace(r, chunks=tuple(dataclasses.replace(c, hash=hashes[c.entry])
                                                   if c.step is None and c.entry in hashes else c for c in r.chunks))
    return r


def _reference_chunks(r: TensorRecord, previous: Manifest, i: int, missing: frozenset[int],
                      dropped: set[str]) -> TensorRecord:
    """Sharded record ``r`` (record ``i``) with each own chunk whose box and hash equal a chunk of ``previous``'s
    record ``i`` turned into a reference to the checkpoint holding it (its entry added to ``dropped``)."""
    p = previous.tensors[i] if i < len(previous.tensors) else None
    if p is None or p.chunks is None or p.dtype != r.dtype or p.shape != r.shape:
        return r
    theirs = {(c.offsets, c.sizes, c.hash): c for c in p.chunks if c.hash is not None}
    chunks = []
    for c in r.chunks or ():
        held = theirs.get((c.offsets, c.sizes, c.hash)) if c.step is None and c.hash is not None else None
        holder = None if held is None else previous.step if held.step is None else held.step
        if held is None or holder in missing:
            chunks.append(c)
            continue
        chunks.append(dataclasses.replace(c, file=held.file, entry=held.entry, step=holder))
        dropped.add(c.entry)
    return dataclasses.replace(r, chunks=tuple(chunks))


def _key(r: TensorRecord) -> tuple:
    return r.dtype, r.shape, r.stride, r.offset


@dataclass(frozen=True)
class Decision:
    """What one incremental save writes.

    Attributes:
        records: the manifest's records: each whole-entry tensor with its hash, the unchanged ones as references.
        dropped: the entries the shard no longer holds (referenced).
        hashed: the records of the same save written full (each whole-entry tensor with its hash, no reference).
    """

    records: tuple[TensorRecord | None, ...]
    dropped: frozenset[str]
    hashed: tuple[TensorRecord | None, ...]

    @property
    def full(self) -> bool:
        return not self.dropped

    def depends_on(self) -> set[int]:
        return {s for r in self.records if r is not None for s, _ in r.references()}


#: entry -> each of its records' key -> (the step holding its bytes, the previous checkpoint's record)
Held = dict[str, dict[tuple, tuple[int, TensorRecord]]]


def _held(previous: Manifest) -> dict[str, list[tuple[int, TensorRecord]]]:
    """Each whole entry of ``previous`` with a hash: the step holding its bytes and each of its records."""
    held: dict[str, list[tuple[int, TensorRecord]]] = {}
    for p in previous.tensors:
        if p.chunks is None and p.hash is not None and p.entry is not None:
            held.setdefault(p.entry, []).append((previous.step if p.step is None else p.step, p))
    return held


def _same(mine: Sequence[TensorRecord], theirs: Sequence[tuple[int, TensorRecord]], digest: str | None,
          missing: frozenset[int]) -> dict[tuple, tuple[int, TensorRecord]] | None:
    """Where the records ``mine`` of one entry (its bytes hashing to ``digest``) are held by ``theirs`` (the previous
    checkpoint's records of the same entry): one step, one file, the same hash, every record's key; else ``None``."""
    steps = {h for h, _ in theirs}
    if digest is None or len(steps) != 1 or steps & missing or any(p.hash != digest for _, p in theirs):
        return None
    by_key = {_key(p): (h, p) for h, p in theirs}
    if not all(_key(r) in by_key for r in mine) or len({p.file for _, p in theirs}) != 1:
        return None
    return {_key(r): by_key[_key(r)] for r in mine}


def unchanged_before_copy(records: Sequence[TensorRecord | None], hashes: Mapping[str, str],
                          previous: Manifest, *, missing: frozenset[int] = frozenset()) -> Held:
    """The entries a save references before it copies them (issue 43: a host tensor hashed where it lies): those of
    ``hashes`` (the xxh3-128 of each candidate entry's source bytes) that ``previous``, the newest committed
    checkpoint, holds with the same hash; where their bytes are. The writer then references them whatever it
    decides for the rest (:func:`reference_unchanged`'s ``known``): their bytes were never staged. ``missing``:
    checkpoints that are gone (never referenced)."""
    held, out = _held(previous), {}
    mine: dict[str, list[TensorRecord]] = {}
    for r in records:
        if hashable(r) and r.entry in hashes:  # type: ignore[union-attr]
            mine.setdefault(r.entry, []).append(r)  # type: ignore[union-attr,arg-type]
    for entry, rs in mine.items():
        found = _same(rs, held.get(entry, []), hashes[entry], missing)
        if found is not None:
            out[entry] = found
    return out


def reference_unchanged(records: Sequence[TensorRecord | None], hashes: Mapping[str, str], previous: Manifest | None,
                        *, since_full: int, full_every: int, max_span: int,
                        missing: frozenset[int] = frozenset(), known: Held | None = None) -> Decision:
    """The records of a save whose whole-entry tensors hash to ``hashes`` (by entry name), referencing those equal
    to ``previous``'s (the newest committed checkpoint; ``None``: none).

    Args:
        records: the save's records as planned (every tensor in its own file).
        hashes: the xxh3-128 (hex) of each whole entry's staged bytes.
        previous: the newest committed checkpoint of this run older than the save, or ``None``.
        since_full: saves since the last full one (0: ``previous`` is full).
        full_every: a full checkpoint at least every this many saves.
        max_span: the most checkpoints one save's references may name.
        missing: checkpoints ``previous`` references that are gone (never referenced).
        known: entries found unchanged before they were copied (:func:`unchanged_before_copy`): referenced where
            they were found, always (their bytes are not in the staged shard).
    """
    hashed = tuple(_hashed(r, hashes) for r in records)
    moved: dict[tuple, tuple[int, TensorRecord]] = {}
    dropped: set[str] = set()
    for entry, where in (known or {}).items():
        moved.update({(entry, k): v for k, v in where.items()})
        dropped.add(entry)
    forced = Decision(_moved(hashed, moved, dropped, None, missing), frozenset(dropped), hashed)
    if previous is None or since_full + 1 >= full_every:
        return forced
    held = _held(previous)
    new: dict[str, list[TensorRecord]] = {}
    for r in hashed:
        if r is not None and r.hash is not None and r.entry not in dropped:
            new.setdefault(r.entry, []).append(r)  # type: ignore[arg-type]
    for entry, mine in new.items():
        found = _same(mine, held.get(entry, []), mine[0].hash, missing)
        if found is not None:
            moved.update({(entry, k): v for k, v in found.items()})
            dropped.add(entry)
    decision = Decision(_moved(hashed, moved, dropped, previous, missing), frozenset(dropped), hashed)
    if len(decision.depends_on()) > max_span:
        return forced
    return decision


def _moved(hashed: tuple[TensorRecord | None, ...], moved: Mapping[tuple, tuple[int, TensorRecord]],
           dropped: set[str], previous: Manifest | None, missing: frozenset[int]) -> tuple[TensorRecord | None, ...]:
    """The records with each dropped entry's records turned into references (``moved``), and, with ``previous``,
    each sharded tensor's unchanged chunks (their entries added to ``dropped``)."""
    out: list[TensorRecord | None] = []
    for i, r in enumerate(hashed):
        if r is not None and r.chunks is not None:  # a sharded tensor: chunk by chunk
            out.append(r if previous is None else _reference_chunks(r, previous, i, missing, dropped))
            continue
        found = None if r is None or r.entry not in dropped else moved[(r.entry, _key(r))]
        out.append(r if found is None else dataclasses.replace(r, file=found[1].file, entry=found[1].entry,
                                                               step=found[0]))
    return tuple(out)


@dataclass(frozen=True)
class Compaction:
    """A staged shard without its dropped entries: the new ``header`` at byte 0, each kept entry's ``copies``
    ``(from, to, nbytes)`` (absolute offsets, ascending, ``to <= from``: safe in order with ``memmove``; all of them
    make the shard in a zeroed buffer of its own, the :attr:`moves` make it in place), the ``zeros`` ranges (the new
    padding, in place), the new file size, and the ``tail`` that ends the file (a torch-loadable shard's archive
    tail, written last: its ``data.pkl`` says what the file is; ``b""`` for none)."""

    header: bytes
    file_bytes: int
    copies: tuple[tuple[int, int, int], ...]
    zeros: tuple[tuple[int, int], ...]
    tail: bytes = b""

    @property
    def moves(self) -> tuple[tuple[int, int, int], ...]:
        """The copies of the entries that do not stay where they are (the shard made in place)."""
        return tuple(c for c in self.copies if c[0] != c[1])


def compact(header: bytes, dropped: frozenset[str], *, image: int = 0, archive: bytes | None = None) -> Compaction | None:
    """The layout of the shard whose safetensors header is ``header`` without the entries ``dropped``: every kept
    entry in the same order, each on a 64-byte boundary, the gaps ``__pad__.N`` entries, the file a multiple of 4
    KiB; ``None`` when it cannot be made in place (its header would grow).

    ``image``: where ``header`` starts in the staged shard (a torch-loadable shard's zip local header before it).
    ``archive``: the compacted shard is a torch-loadable one again (issue 53), a zip archive whose ``data.pkl`` is
    these bytes (:class:`~persist_core.format.torch_zip.ReferencingShard`: ``torch.load`` fails naming what the file
    is and how to load it; the kept entries are no records of it, the dropped ``__pad__`` entries held those); its
    header is the zip local header of ``archive/.persist_header`` again, its last entry the archive's tail. Without
    ``archive`` it starts with its safetensors header."""
    (n,) = struct.unpack("<Q", header[:8])
    entries = json.loads(header[8 : 8 + n])
    meta = entries.pop("__metadata__", None)
    kept = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in entries.items()
                  if not name.startswith("__pad__") and name not in dropped)
    out: dict = {} if meta is None else {"__metadata__": meta}
    places, pos, pads = [], 0, 0
    for begin, end, name in kept:
        start = pos + -pos % ENTRY_ALIGN_BYTES
        if start != pos:
            out[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [start - pos], "data_offsets": [pos, start]}
            pads += 1
        out[name] = {**entries[name], "data_offsets": [start, start + end - begin]}
        places.append((begin, start, end - begin, pos))
        pos = start + end - begin
    gap, tail = -pos % PAGE_BYTES, b""
    if archive is not None:  # the tail ends the file on 4 KiB itself
        (new, tail), gap = _archive(out, pos, archive), 0
    else:
        if gap:
            out[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
        new = encode_header(out)
    if len(new) > image + len(header):
        return None
    old, h = image + len(header), len(new)
    copies = tuple((old + b, h + s, size) for b, s, size, _ in places if size)
    zeros = tuple((h + p, h + s) for _, s, _, p in places if s > p) + ((h + pos, h + pos + gap),) * bool(gap)
    return Compaction(header=new, file_bytes=h + pos + gap + len(tail), copies=copies, zeros=zeros, tail=tail)


def _archive(entries: dict, pos: int, data_pkl: bytes) -> tuple[bytes, bytes]:
    """``(the file's header, the archive's tail)`` of a compacted torch-loadable shard whose safetensors ``entries``
    end at ``pos`` (:func:`compact`): the tail is its last entry, right there; offsets in it are absolute, and the
    header's length depends on them only past ZIP64's limits (as :func:`~persist_core.planning.torch_loadable.lay_out`
    settles it)."""
    header_len = 2 * PAGE_BYTES
    for _ in range(4):
        tail = zip_tail([Record(HEADER_RECORD, 0, header_len - PAGE_BYTES)], data_pkl, start=header_len + pos,
                        align=PAGE_BYTES)
        st_header = encode_header({**entries, TAIL_ENTRY: {"dtype": "U8", "shape": [len(tail)],
                                                           "data_offsets": [pos, pos + len(tail)]}})
        header = header_record(len(st_header), PAGE_BYTES) + st_header
        if len(header) == header_len:
            return header, tail
        header_len = len(header)
    raise AssertionError("the compacted shard's header did not settle")
