"""What a shard's data section holds, one entry per kind of leaf, before anything is placed.

Each kind of leaf a flattened state holds becomes one :class:`Item` (an entry of the shard file):

=========================  =====================================  ==========================================
leaf                       function                               entry
=========================  =====================================  ==========================================
a tensor alone in its      :func:`plain_item`                     its bytes, as its dtype and shape (bytes,
storage                                                           ``U8``, where safetensors has no such dtype)
tensors sharing a storage  :func:`shared_item`                    ``__shared__.N``: the bytes of the storage
(tied weights, views)                                             they span, from a 64-byte aligned start
a ``DTensor``'s local part :func:`dtensor_item`                   as a plain tensor, on the replica that writes it
pickled leaves             :func:`blob_item`                      ``__objects__`` / ``__per_rank__``: the bytes
=========================  =====================================  ==========================================

Each item says what the staging copy reads (``source``, viewed as ``view``/``view_shape``), where that
source is in a flattened state (its :data:`Slot`, so a cached plan is filled from the next state of
the same structure) and which state tensors it holds (:class:`Member`: their byte offsets and strides,
from which the manifest's typed records are made, :func:`records`). :func:`plan_items` walks a state and
calls these in file order. Pure functions: no I/O, every rank computes the same answer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from persist_core._knobs import ENTRY_ALIGN_BYTES
from persist_core.format.records import TensorRecord
from persist_core.format.shard_file import OBJECTS_ENTRY, PER_RANK_ENTRY, _RESERVED_PREFIXES, dtype_name, safetensors_dtype
from persist_core.format.tree import FlatState
from persist_core.planning.partition import _span
from persist_core.planning.sharding import Sharding


class SpanSlot(NamedTuple):
    """The source is ``nbytes`` bytes at byte ``begin`` of the storage state tensor ``index`` shares with others."""

    index: int
    begin: int
    nbytes: int

    def take(self, flat: FlatState) -> torch.Tensor:
        first = flat.tensors[self.index][1]
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), self.begin,
                                                                           (self.nbytes,), (1,))


class BlobSlot(NamedTuple):
    """The source is the state's pickled leaves joined: its :class:`~persist_core.format.tree.PerRank`
    values (``per_rank``) or its other pickled leaves."""

    per_rank: bool

    def take(self, flat: FlatState) -> bytes:
        return b"".join(flat.per_rank if self.per_rank else flat.objects)


class Member(NamedTuple):
    """A state tensor held by an item: its index in the flattened state, the byte offset of its first
    element in the item, and its stride (``None``: C-contiguous, the item is the tensor).

    As a copy's :data:`Slot` (a plain item's), the source is that tensor itself."""

    index: int
    offset: int = 0
    stride: tuple[int, ...] | None = None

    def take(self, flat: FlatState) -> torch.Tensor:
        return flat.tensors[self.index][1]


#: where a copy's source is in a flattened state
Slot = Member | SpanSlot | BlobSlot


class Item(NamedTuple):
    """One entry of a shard's data section, not yet placed.

    A named tuple, not a frozen dataclass: a plan makes one per storage, and planning is on the training thread.
    """

    name: str  # the entry's name in the shard header
    dtype: str  # its safetensors dtype ("U8": bytes)
    shape: tuple[int, ...]  # its safetensors shape
    nbytes: int
    source: torch.Tensor | bytes  # what the staging copy reads ...
    view: torch.dtype  # ... viewed as this dtype ...
    view_shape: tuple[int, ...]  # ... and shape
    slot: Slot
    members: tuple[Member, ...] = ()  # the state tensors it holds; none for pickled bytes


#: builds a named tuple from a tuple of its fields in order: 0.1-0.2 us, where calling the class (its ``__new__``
#: takes keywords) costs 0.4-0.6 us; planning makes two per tensor, on the training thread
_new = tuple.__new__


class EntryNames:
    """The entry names of one shard file, each given once: a key path, ``#1``, ``#2`` ... on a repeat.
    A user's key path never takes an internal entry's name (``__pad__.0`` becomes ``___pad__.0``)."""

    def __init__(self) -> None:
        self._taken: set[str] = set()

    def take(self, path: str, *, internal: bool = False) -> str:
        base = path or "<root>"
        if not internal and base.startswith(_RESERVED_PREFIXES):
            base = "_" + base
        name, n = base, 0
        while name in self._taken:
            n += 1
            name = f"{base}#{n}"
        self._taken.add(name)
        return name


def plain_item(flat: FlatState, index: int, names: EntryNames) -> Item:
    """State tensor ``index``, alone in its storage: an entry of its dtype and shape holding its elements
    (contiguous, from offset 0), or of its bytes (``U8``) for a dtype safetensors does not name."""
    path, t = flat.tensors[index]
    nbytes = t.numel() * t.element_size()
    st = safetensors_dtype(t.dtype)
    shape = t.shape  # a torch.Size: a tuple
    member = _new(Member, (index, 0, None))
    return _new(Item, (names.take(path), st or "U8", shape if st else (nbytes,), nbytes, t, t.dtype, shape, member,
                       (member,)))


def shared_item(flat: FlatState, group: list[int], number: int, names: EntryNames) -> Item:
    """State tensors ``group`` (they share one storage; ``number``: the group's place among the state's
    groups): one ``U8`` entry ``__shared__.<number>`` with the storage bytes they span, from the
    64-byte aligned byte at or before the first; each member at its byte offset, with its stride."""
    spans = [_span(flat.tensors[i][1]) for i in group]
    lo = min(b for b, _ in spans) // ENTRY_ALIGN_BYTES * ENTRY_ALIGN_BYTES
    hi = max(e for _, e in spans)
    slot = SpanSlot(group[0], lo, hi - lo)
    members = tuple(Member(i, b - lo, tuple(flat.tensors[i][1].stride())) for i, (b, _) in zip(group, spans))
    return Item(names.take(f"__shared__.{number}", internal=True), "U8", (hi - lo,), hi - lo, slot.take(flat),
                torch.uint8, (hi - lo,), slot, members)


def dtensor_item(flat: FlatState, index: int, sharding: Sharding, names: EntryNames) -> Item | None:
    """The local part of a ``DTensor`` (state tensor ``index``, taken apart by
    :func:`~persist_core.planning.sharding.localize`): an entry as a plain tensor's, on the replica that
    writes it; ``None`` (and no name taken) on the others."""
    return plain_item(flat, index, names) if sharding.writes else None


def blob_item(flat: FlatState, *, per_rank: bool) -> Item:
    """The state's pickled leaves joined, one ``U8`` entry: ``__per_rank__`` (its
    :class:`~persist_core.format.tree.PerRank` values) or ``__objects__`` (the others; :func:`spans`
    says where each is)."""
    slot = BlobSlot(per_rank)
    blob = slot.take(flat)
    return Item(PER_RANK_ENTRY if per_rank else OBJECTS_ENTRY, "U8", (len(blob),), len(blob), blob, torch.uint8,
                (len(blob),), slot)


def plan_items(flat: FlatState, groups: list[list[int]], owners: list[int] | None, rank: int,
               shardings: dict[int, Sharding]) -> list[Item]:
    """The entries of ``rank``'s shard, in file order: the storage groups it owns (all without
    ``owners``), the sharded parts it writes, its per-rank values, and (rank 0) the pickled leaves."""
    names = EntryNames()
    items = [plain_item(flat, group[0], names) if len(group) == 1 else shared_item(flat, group, number, names)
             for number, group in enumerate(groups) if owners is None or owners[number] == rank]
    for index, sharding in shardings.items():
        part = dtensor_item(flat, index, sharding, names)
        if part is not None:
            items.append(part)
    if flat.per_rank:
        items.append(blob_item(flat, per_rank=True))
    if flat.objects and rank == 0:
        items.append(blob_item(flat, per_rank=False))
    return items


def records(flat: FlatState, items: list[Item], file: str) -> list[TensorRecord | None]:
    """One manifest record per state tensor (``None`` for those no item holds): in ``file``, the entry holding
    it, its dtype, shape and stride (``None``: C-contiguous) and the byte offset of its first element."""
    tensors = flat.tensors
    out: list[TensorRecord | None] = [None] * len(tensors)
    dtype_names: dict[torch.dtype, str] = {}  # a state has a few dtypes and thousands of tensors
    for item in items:
        for index, offset, stride in item.members:
            t = tensors[index][1]
            dtype = dtype_names.get(t.dtype) or dtype_names.setdefault(t.dtype, dtype_name(t.dtype))
            out[index] = TensorRecord(dtype=dtype, shape=tuple(t.shape), file=file, entry=item.name, stride=stride,
                                      offset=offset, replicated=True)
    return out


def spans(blobs: list[bytes]) -> list[tuple[int, int]]:
    """``(begin, length)`` of each of ``blobs`` in their concatenation."""
    out, pos = [], 0
    for b in blobs:
        out.append((pos, len(b)))
        pos += len(b)
    return out
