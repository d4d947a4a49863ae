"""What one rank writes: the byte layout of its shard file and where each byte comes from.

:func:`plan_rank` flattens a state and lays out this rank's shard of it (:class:`RankPlan`), reusing
the layout of the last state of the same structure (:class:`PlanCache`). :func:`plan_shard` turns a
flattened state (and, with several ranks, the owner of each storage group) into a
:class:`ShardPlan`: the header bytes, the copies that fill the data section, and the manifest
records. It runs in passes, each its own module:

1. what the shard holds, one item per kind of leaf (:mod:`persist_core.planning.items`);
2. where each item's bytes go (:mod:`persist_core.planning.section`), or, for a torch-loadable shard,
   the same with the zip archive ``torch.load`` reads around them
   (:mod:`persist_core.planning.torch_loadable`);
3. the manifest's typed records of the tensors the items hold (:func:`~persist_core.planning.items.records`).

The staging copy (:mod:`persist_core.staging.stage`) executes the plan. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from persist_core.format.manifest import Manifest
from persist_core.format.records import Chunk, TensorRecord
from persist_core.format.shape import Shape
from persist_core.format.shard_file import dtype_name
from persist_core.format.torch_zip import SplitShard
from persist_core.format.tree import FlatState, flatten
from persist_core.layout import shard_filename
from persist_core.planning.items import Slot, plan_items, records, spans
from persist_core.planning.partition import assign_owners, storage_groups, structure_signature
from persist_core.planning.section import DataSection, EntryCopy
from persist_core.planning.sharding import Sharding, localize, replica_digests
from persist_core.planning.torch_loadable import lay_out, storage_refs

_new = tuple.__new__  # a named tuple from its fields in order, without its __new__'s keyword handling

__all__ = ["EntryCopy", "PlanCache", "RankPlan", "ShardPlan", "plan_rank", "plan_shard"]


@dataclass(frozen=True)
class ShardPlan:
    """Where each byte of one shard file comes from. Holds references to the source tensors.

    Attributes:
        header: the file's first ``len(header)`` bytes (a multiple of 4 KiB).
        file_bytes: total file size (a multiple of 4 KiB).
        copies: what to copy where; offsets are relative to the data section.
        records: one per state tensor, for the manifest (in this shard file: its entry, dtype, shape, stride,
            offset); ``None`` for a tensor another rank writes. A sharded tensor's is its local part's, which
            :meth:`RankPlan.manifest` makes a chunk of its record.
        objects: ``(begin, length)`` of each pickled leaf inside the ``__objects__`` entry.
    """

    header: bytes
    file_bytes: int
    copies: list[EntryCopy]
    records: list[TensorRecord | None]
    objects: list[tuple[int, int]]
    torch_zip: bool = False  # the file is also the zip archive torch.load reads (format/torch_zip.py)
    slots: tuple[Slot | None, ...] = ()  # per copy, where its source is in a flattened state (see rebind); None: bytes

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - len(self.header)

    def rebind(self, flat: FlatState) -> ShardPlan:
        """This layout filled from ``flat``, a state of the same structure (:class:`PlanCache` decides that):
        the same header, records and offsets, each copy's source taken from ``flat``."""
        return dataclasses.replace(self, copies=[
            c if s is None else _new(EntryCopy, (c.begin, c.end, s.take(flat), c.dtype, c.shape, c.name))
            for c, s in zip(self.copies, self.slots)])

    def unbound(self) -> ShardPlan:
        """This layout without its sources (what a cache keeps: no tensor stays alive for it)."""
        return dataclasses.replace(self, copies=[c if s is None else c._replace(source=b"")
                                                 for c, s in zip(self.copies, self.slots)])


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
    items = plan_items(flat, groups, owners, rank, shardings)
    section = DataSection()
    refs = None
    if torch_zip is not None and (owners is None or rank == 0) and not shardings and not flat.per_rank:
        refs = storage_refs(flat, items, split=owners is not None)
    if refs is None:
        section.place(items)
        header = section.close()
    else:
        header = lay_out(section, items, refs, torch_zip)
    zipped = refs is not None
    return ShardPlan(header=header, file_bytes=len(header) + section.pos, copies=section.copies,
                     records=records(flat, items, shard_filename(rank, torch_zip=zipped)), objects=spans(flat.objects) if flat.objects and rank == 0 else [],
                     torch_zip=zipped, slots=tuple(section.slots))


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
        records = list(self.shard.records)  # the plain tensors' records as planned (in this file)
        for i, sh in self.shardings.items():  # a sharded tensor: its global shape and the chunks ranks add
            r = records[i]
            chunk = () if r is None else (Chunk(file=shard, entry=r.entry, offsets=tuple(sh.offsets),  # type: ignore
                                                sizes=tuple(sh.sizes)),)
            records[i] = TensorRecord(dtype=dtype_name(self.flat.tensors[i][1].dtype), shape=tuple(sh.shape),
                                      placements=sh.placements, mesh=tuple(sh.mesh), chunks=chunk)
        per_rank = ((tuple((shard, b, n) for b, n in spans(self.flat.per_rank)),) if self.flat.per_rank else ())
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
              replica_check: str = "sampled", seed: int = 0, cache: PlanCache | None = None,
              split: bool = True) -> RankPlan:
    """Flatten ``state`` and lay out ``rank``'s shard of it: about ``1/world_size`` of its replicated
    tensors, the local parts of its ``DTensor`` leaves that this rank is the first replica of, and its
    :class:`~persist_core.format.tree.PerRank` values.

    ``torch_loadable``: with one writer the shard is also the zip archive ``torch.load`` reads; with
    several, rank 0's is an archive whose loading raises an error naming how to load the checkpoint.
    ``replica_check``/``seed``: how the tensors taken to be replicated are digested for the ranks to
    compare (:func:`~persist_core.planning.sharding.replica_digests`). ``cache``: reuse the layout of the
    last state of the same structure (:class:`PlanCache`). ``split=False``: each ``DTensor``'s whole local part,
    also where other ranks hold the same (a memory snapshot of this rank's own state).

    Raises:
        UnsupportedStateError: a leaf cannot be saved (its key path is named).
    """
    cache = None if torch_loadable else cache  # torch.save's zip layout holds values: never cached
    flat, shardings = localize(flatten(state) if cache is None else cache.flatten(state), split=split)
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

