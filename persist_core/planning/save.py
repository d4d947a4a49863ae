"""What one rank writes: the byte layout of its shard file and where each byte comes from.

:func:`plan_shard` turns a flattened state (and, with several ranks, the owner of each storage
group) into a :class:`ShardPlan`: the header bytes, the copies that fill the data section, and
the manifest records. The staging copy (:mod:`persist_core.save.staging`) executes it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from persist_core._knobs import ENTRY_ALIGN_BYTES, PAGE_BYTES
from persist_core.format.shard_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    OBJECTS_ENTRY,
    PER_RANK_ENTRY,
    _RESERVED_PREFIXES,
    dtype_name,
    encode_header,
    safetensors_dtype,
)
from persist_core.format.manifest import Manifest
from persist_core.format.torch_zip import (HEADER_RECORD, Record, SplitShard, StorageRef, header_record, local_header,
                                           pickle_state, record_name, storage_type, zip_tail)
from persist_core.format.shape import Shape
from persist_core.format.tree import FlatState, flatten
from persist_core.layout import shard_filename
from persist_core.planning.partition import _span, assign_owners, contiguous_strides, storage_groups, structure_signature
from persist_core.planning.sharding import Sharding, localize, replica_digests

log = logging.getLogger(__name__)


class EntryCopy(NamedTuple):
    """Copy ``source`` (viewed as ``dtype``/``shape``) into the data bytes ``[begin, end)``.

    A named tuple, not a frozen dataclass: a cached plan makes one per tensor every save (0.3 us, not 2)."""

    begin: int
    end: int
    source: torch.Tensor | bytes
    dtype: torch.dtype
    shape: tuple[int, ...]
    name: str = ""  # the shard entry it fills (for messages)


@dataclass(frozen=True)
class ShardPlan:
    """Where each byte of one shard file comes from. Holds references to the source tensors.

    Attributes:
        header: the file's first ``len(header)`` bytes (a multiple of 4 KiB).
        file_bytes: total file size (a multiple of 4 KiB).
        copies: what to copy where; offsets are relative to the data section.
        records: one per state tensor, for the manifest (entry, dtype, shape, stride, offset);
            ``None`` for a tensor another rank writes.
        objects: ``(begin, length)`` of each pickled leaf inside the ``__objects__`` entry.
    """

    header: bytes
    file_bytes: int
    copies: list[EntryCopy]
    records: list[dict[str, Any] | None]
    objects: list[tuple[int, int]]
    torch_zip: bool = False  # the file is also the zip archive torch.load reads (format/torch_zip.py)
    slots: tuple[Any, ...] = ()  # per copy, where its source is in a flattened state (see rebind); None: bytes

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - len(self.header)

    def rebind(self, flat: FlatState) -> ShardPlan:
        """This layout filled from ``flat``, a state of the same structure (:class:`PlanCache` decides that):
        the same header, records and offsets, each copy's source taken from ``flat``."""
        return dataclasses.replace(self, copies=[c if s is None else EntryCopy(c.begin, c.end, _source(flat, s), c.dtype,
                                                                               c.shape, c.name)
                                                 for c, s in zip(self.copies, self.slots)])

    def unbound(self) -> ShardPlan:
        """This layout without its sources (what a cache keeps: no tensor stays alive for it)."""
        return dataclasses.replace(self, copies=[c if s is None else c._replace(source=b"")
                                                 for c, s in zip(self.copies, self.slots)])


def _source(flat: FlatState, slot: tuple[Any, ...]) -> torch.Tensor | bytes:
    """The bytes a copy reads, by its slot: ``("tensor", i)``, ``("span", i, lo, n)`` (``n`` bytes at ``lo``
    of tensor ``i``'s storage, which other tensors share), ``("per_rank",)`` or ``("objects",)``."""
    kind = slot[0]
    if kind == "tensor":
        return flat.tensors[slot[1]][1]
    if kind == "span":
        first = flat.tensors[slot[1]][1]
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), slot[2],
                                                                           (slot[3],), (1,))
    return b"".join(flat.per_rank if kind == "per_rank" else flat.objects)


def plan_shard(flat: FlatState, *, groups: list[list[int]] | None = None, owners: list[int] | None = None,
               rank: int = 0, torch_zip: Any = None, shardings: dict[int, Sharding] | None = None) -> ShardPlan:
    """Lay out one shard file for ``flat`` (see the module docstring).

    With ``owners`` (one rank per storage group, see :func:`assign_owners`), only the groups
    ``rank`` owns are laid out, and the pickled objects only on rank 0; the records of the
    other tensors are ``None``. With ``torch_zip`` (the state ``flat`` was made from; one writer
    only) the file is also the zip archive ``torch.load`` reads, where the state allows it
    (:mod:`persist_core.format.torch_zip`; otherwise the plan says ``torch_zip=False``).
    ``shardings``: the local parts of sharded tensors (:func:`~persist_core.planning.sharding.localize`),
    each an entry of its own on the rank that writes it, whatever the owners; not in ``groups``.
    """
    shardings = shardings or {}
    groups = storage_groups(flat, skip=shardings) if groups is None else groups

    names: set[str] = set()

    def unique(path: str, *, internal: bool = False) -> str:
        base = path or "<root>"
        if not internal and base.startswith(_RESERVED_PREFIXES):
            base = "_" + base  # user keys never take an internal entry's name
        name, n = base, 0
        while name in names:
            n += 1
            name = f"{base}#{n}"
        names.add(name)
        return name

    pending: list[tuple[str, str, list[int], int, Any, torch.dtype, tuple[int, ...], tuple[Any, ...]]] = []
    records: list[dict[str, Any] | None] = [None for _ in flat.tensors]
    for n_shared, idxs in enumerate(groups):
        if owners is not None and owners[n_shared] != rank:
            continue
        if len(idxs) == 1:
            path, t = flat.tensors[idxs[0]]
            name = unique(path)
            nbytes = t.numel() * t.element_size()
            st = safetensors_dtype(t.dtype)
            shape = list(t.shape) if st else [nbytes]
            pending.append((name, st or "U8", shape, nbytes, t, t.dtype, tuple(t.shape), ("tensor", idxs[0])))
            records[idxs[0]] = {"entry": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": None, "offset": 0}
            continue
        spans = [_span(flat.tensors[i][1]) for i in idxs]
        lo = min(b for b, _ in spans) // ENTRY_ALIGN_BYTES * ENTRY_ALIGN_BYTES
        hi = max(e for _, e in spans)
        slot = ("span", idxs[0], lo, hi - lo)
        name = unique(f"__shared__.{n_shared}", internal=True)
        pending.append((name, "U8", [hi - lo], hi - lo, _source(flat, slot), torch.uint8, (hi - lo,), slot))
        for i, (b, _) in zip(idxs, spans):
            t = flat.tensors[i][1]
            records[i] = {"entry": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": list(t.stride()), "offset": b - lo}

    for i, sharding in shardings.items():
        path, t = flat.tensors[i]
        if not sharding.writes:
            continue
        name = unique(path)
        nbytes = t.numel() * t.element_size()
        st = safetensors_dtype(t.dtype)
        pending.append((name, st or "U8", list(t.shape) if st else [nbytes], nbytes, t, t.dtype, tuple(t.shape),
                        ("tensor", i)))
        records[i] = {"entry": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": None, "offset": 0}
    if flat.per_rank:
        blob = b"".join(flat.per_rank)
        pending.append((PER_RANK_ENTRY, "U8", [len(blob)], len(blob), blob, torch.uint8, (len(blob),), ("per_rank",)))

    objects: list[tuple[int, int]] = []
    if flat.objects and rank == 0:
        blob = b"".join(flat.objects)
        pos = 0
        for o in flat.objects:
            objects.append((pos, len(o)))
            pos += len(o)
        pending.append((OBJECTS_ENTRY, "U8", [len(blob)], len(blob), blob, torch.uint8, (len(blob),), ("objects",)))

    if torch_zip is None or (owners is not None and rank != 0) or shardings or flat.per_rank:
        zipped = None
    elif owners is not None:  # rank 0 of split writes: an archive whose data.pkl says where the state is
        zipped = ({}, {})
    else:
        zipped = _zip_refs(flat, groups, pending, records)
    header_entries: dict[str, Any] = {"__metadata__": {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}}
    copies: list[EntryCopy] = []
    slots: list[tuple[Any, ...] | None] = []
    pos = 0
    n_pad = 0
    zip_records: list[tuple[bytes, int, int]] = []  # (name, local header at, size), data-relative

    def pad_to(align: int) -> None:
        nonlocal pos, n_pad
        gap = -pos % align
        if gap:
            header_entries[f"__pad__.{n_pad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            n_pad += 1
            pos += gap

    for name, st, shape, nbytes, source, dtype, tshape, slot in pending:
        key = None if zipped is None else zipped[0].get(name)
        if key is None:
            pad_to(ENTRY_ALIGN_BYTES)
        else:  # the record's local header ends the pad before it: the data stays where it would be
            lh = local_header(record_name(key), nbytes)
            start = pos + len(lh)
            start += -start % ENTRY_ALIGN_BYTES
            gap = start - pos
            header_entries[f"__pad__.{n_pad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, start]}
            n_pad += 1
            copies.append(EntryCopy(pos, start, bytes(gap - len(lh)) + lh, torch.uint8, (gap,)))
            slots.append(None)
            zip_records.append((record_name(key), start - len(lh), nbytes))
            pos = start
        header_entries[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        if nbytes:
            copies.append(EntryCopy(pos, pos + nbytes, source, dtype, tshape, name))
            slots.append(slot)
        pos += nbytes
    if zipped is None:
        pad_to(PAGE_BYTES)
        header = encode_header(header_entries)
        return ShardPlan(header=header, file_bytes=len(header) + pos, copies=copies, records=records, objects=objects,
                         slots=tuple(slots))

    data_pkl = pickle_state(torch_zip, zipped[1])
    header_len, tail, header = 2 * PAGE_BYTES, b"", b""
    for _ in range(4):  # offsets in the tail are absolute; its length depends on them only past ZIP64's limits
        st_len = header_len - PAGE_BYTES
        placed = [Record(HEADER_RECORD, 0, st_len), *(Record(n, header_len + at, size) for n, at, size in zip_records)]
        tail = zip_tail(placed, data_pkl, start=header_len + pos, align=PAGE_BYTES)
        header_entries["__pad__.zip"] = {"dtype": "U8", "shape": [len(tail)], "data_offsets": [pos, pos + len(tail)]}
        st_header = encode_header(header_entries)
        header = header_record(len(st_header), PAGE_BYTES) + st_header
        if len(header) == header_len:
            break
        header_len = len(header)
    else:
        raise AssertionError("the shard header did not settle")
    copies.append(EntryCopy(pos, pos + len(tail), tail, torch.uint8, (len(tail),)))
    slots.append(None)
    pos += len(tail)
    return ShardPlan(header=header, file_bytes=len(header) + pos, copies=copies, records=records, objects=objects,
                     torch_zip=True, slots=tuple(slots))


def _zip_refs(flat: FlatState, groups: list[list[int]], pending: list[tuple[Any, ...]],
              records: list[dict[str, Any] | None]) -> tuple[dict[str, str], dict[int, Any]] | None:
    """``({entry: storage key}, {id(tensor): (StorageRef, offset, shape, stride)})`` for ``data.pkl``,
    or ``None`` when torch's format cannot say the state (a dtype without a torch storage type, a
    storage group viewed as several dtypes)."""
    keys = {p[0]: str(k) for k, p in enumerate(x for x in pending if x[0] != OBJECTS_ENTRY)}
    sizes = {p[0]: p[3] for p in pending}
    refs: dict[int, Any] = {}
    for idxs in groups:
        dtypes = {flat.tensors[i][1].dtype for i in idxs}
        dtype = next(iter(dtypes))
        stype = storage_type(dtype)
        record = records[idxs[0]]
        if len(dtypes) != 1 or stype is None or record is None:
            log.debug("state cannot be written in torch.save's zip layout (%s); writing safetensors only", dtypes)
            return None
        size = flat.tensors[idxs[0]][1].element_size()
        entry = record["entry"]
        if sizes[entry] % size:
            return None
        ref = StorageRef(keys[entry], stype, sizes[entry] // size)
        for i in idxs:
            t, rec = flat.tensors[i][1], records[i]
            assert rec is not None
            stride = tuple(rec["stride"]) if rec["stride"] is not None else contiguous_strides(tuple(t.shape))
            if rec["offset"] % size:
                return None
            refs[id(t)] = (ref, rec["offset"] // size, tuple(t.shape), stride)
    return keys, refs



@dataclass(frozen=True)
class RankPlan:
    """What one rank writes of a state: the flattened state, its shard plan, the structure digest, the
    sharded tensors' layouts and the digests of the tensors taken to be replicated."""

    flat: FlatState
    shard: ShardPlan
    signature: str  # "" with one rank; ranks compare it before committing
    rank: int
    shardings: dict[int, Sharding] = field(default_factory=dict)
    digests: list[int | None] = field(default_factory=list)  # ranks compare them before committing

    @property
    def filename(self) -> str:
        """The name of this rank's shard file."""
        return shard_filename(self.rank, torch_zip=self.shard.torch_zip)

    def manifest(self, *, step: int, time: float, metadata: dict[str, Any] | None) -> Manifest:
        """This rank's manifest so far: records for the tensors it writes, no files yet (the commit adds them)."""
        shard = self.filename
        records = [None if r is None else {"file": shard, **r, "replicated": True} for r in self.shard.records]
        for i, sh in self.shardings.items():  # a sharded tensor: its global shape and the chunks ranks add
            r = self.shard.records[i]
            chunk = [] if r is None else [{"file": shard, "entry": r["entry"], "offsets": list(sh.offsets),
                                           "sizes": list(sh.sizes)}]
            records[i] = {"dtype": dtype_name(self.flat.tensors[i][1].dtype), "shape": list(sh.shape),
                          "placements": sh.placements, "mesh": list(sh.mesh), "chunks": chunk}
        per_rank = ((tuple((shard, b, n) for b, n in _spans(self.flat.per_rank)),) if self.flat.per_rank else ())
        return Manifest(step=step, time=time, world_size=1, tree=self.flat.tree, tensors=tuple(records),
                        objects=tuple((shard, b, n) for b, n in self.shard.objects), files=(),
                        metadata=dict(metadata or {}), per_rank=per_rank)


class PlanCache:
    """The last state structure's shard layout, so that saving a state of the same structure again (the
    usual case: the same model and optimizer every save) flattens it and rebinds the copies' sources, and
    lays nothing out again.

    The key is everything the layout depends on: each tensor's path, dtype, device, shape, stride and
    storage offset, which tensors share a storage, the sharded parts, the lengths of the pickled leaves
    and of the per-rank values, the rank and the world size. States written as torch.save's zip layout
    are not cached (their ``data.pkl`` holds the state's values). One entry: another structure replaces it.
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._value: tuple[ShardPlan, str] | None = None
        self.shape: Shape | None = None  # the last state's structure: the next one is taken apart by it
        self.hits = 0
        self.misses = 0

    def flatten(self, state: Any) -> FlatState:
        """``flatten(state)``: by the learned :class:`~persist_core.format.shape.Shape` when the state has the
        last one's structure (no node-by-node walk), else by walking it (and learning its shape)."""
        flat = None if self.shape is None else self.shape.take(state)
        if flat is None:
            flat = flatten(state)
            self.shape = Shape.learn(flat)
        return flat

    @staticmethod
    def key(flat: FlatState, groups: list[list[int]], shardings: dict[int, Sharding], rank: int,
            world_size: int) -> Any:
        return (rank, world_size,
                tuple((p, t.dtype, t.device, t.shape, t.stride(), t.storage_offset()) for p, t in flat.tensors),
                tuple(map(tuple, groups)), tuple(sorted(shardings.items())), tuple(map(len, flat.objects)),
                tuple(map(len, flat.per_rank)))

    def get(self, key: Any) -> tuple[ShardPlan, str] | None:
        if self._value is not None and key == self._key:
            self.hits += 1
            return self._value
        self.misses += 1
        return None

    def put(self, key: Any, shard: ShardPlan, signature: str) -> None:
        self._key, self._value = key, (shard.unbound(), signature)


def plan_rank(state: Any, *, rank: int, world_size: int, torch_loadable: bool = False,
              replica_check: str = "sampled", seed: int = 0, cache: PlanCache | None = None) -> RankPlan:
    """Flatten ``state`` and lay out ``rank``'s shard of it: about ``1/world_size`` of its replicated
    tensors, the local parts of its ``DTensor`` leaves that this rank is the first replica of, and its
    :class:`~persist_core.format.tree.PerRank` values.

    ``torch_loadable``: with one writer the shard is also the zip archive ``torch.load`` reads; with
    several, rank 0's is an archive whose loading raises an error naming how to load the checkpoint.
    ``replica_check``/``seed``: how the tensors taken to be replicated are digested for the ranks to
    compare (:func:`~persist_core.planning.sharding.replica_digests`). ``cache``: reuse the layout of the
    last state of the same structure (:class:`PlanCache`).

    Raises:
        UnsupportedStateError: a leaf cannot be saved (its key path is named).
    """
    cache = None if torch_loadable else cache  # torch.save's zip layout holds values: never cached
    flat, shardings = localize(flatten(state) if cache is None else cache.flatten(state))
    groups = storage_groups(flat, skip=shardings)
    key = None if cache is None else PlanCache.key(flat, groups, shardings, rank, world_size)
    hit = None if cache is None else cache.get(key)
    if hit is not None:
        shard, signature = hit[0].rebind(flat), hit[1]
    else:
        owners = assign_owners(flat, groups, world_size) if world_size > 1 else None
        zipped = None if not torch_loadable else state if world_size == 1 else SplitShard(world_size)
        shard = plan_shard(flat, groups=groups, owners=owners, rank=rank, torch_zip=zipped, shardings=shardings)
        signature = structure_signature(flat, groups, shardings) if owners is not None else ""
        if cache is not None:
            cache.put(key, shard, signature)
    digests = replica_digests(flat, shardings, mode=replica_check, seed=seed) if world_size > 1 else []
    return RankPlan(flat=flat, shard=shard, signature=signature, rank=rank, shardings=shardings, digests=digests)


def _spans(blobs: list[bytes]) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for b in blobs:
        spans.append((pos, len(b)))
        pos += len(b)
    return spans
