"""The torch-loadable layout, a pass of its own: a shard that is also the zip archive ``torch.load`` reads.

After :func:`~persist_core.planning.items.plan_items` has said what the shard holds, this pass
decides whether ``torch.save``'s format can say it (:func:`storage_refs`: each item holding tensors
becomes the storage record ``archive/data/<K>``) and lays the items out with each record's local
header at the end of the pad before it, then the archive's tail, then the header record that makes
the safetensors header the archive's first record (:func:`lay_out`). The bytes are
:mod:`persist_core.format.torch_zip`'s; this pass only places them. Pure: no I/O.

Who calls what: :func:`persist_core.planning.save.plan_shard`, for a single writer's shard (or rank
0's of a split state, an archive whose ``data.pkl`` raises an error naming how to load it) when
the state has neither sharded parts nor per-rank values.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from persist_core._knobs import PAGE_BYTES
from persist_core.format.shard_file import OBJECTS_ENTRY
from persist_core.format.torch_zip import (HEADER_RECORD, Record, StorageRef, header_record, local_header, pickle_state,
                                           record_name, storage_type, zip_tail)
from persist_core.format.tree import FlatState
from persist_core.planning.items import Item
from persist_core.planning.partition import contiguous_strides
from persist_core.planning.section import DataSection

log = logging.getLogger(__name__)
_new = tuple.__new__  # a named tuple from its fields in order, without its __new__'s keyword handling

TAIL_ENTRY = "__pad__.zip"  # the safetensors entry over the archive's tail


class TensorRef(NamedTuple):
    """Where ``data.pkl`` says a tensor is: its storage record, its element offset there, its shape and stride
    (unpacked by :func:`~persist_core.format.torch_zip.pickle_state` as ``torch._utils._rebuild_tensor_v2``'s)."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class StorageRefs(NamedTuple):
    """The archive's records: the storage key of each item's entry, and each state tensor's place (by ``id``)."""

    keys: dict[str, str]
    tensors: dict[int, TensorRef]


def storage_refs(flat: FlatState, items: list[Item], *, split: bool = False) -> StorageRefs | None:
    """Each item's storage key and each tensor's place for ``data.pkl``, or ``None`` when torch's format
    cannot say the state (a dtype without a torch storage type, a storage viewed as several dtypes, an
    entry or offset that is not a whole number of elements). ``split``: rank 0's shard of a state
    split across ranks, whose archive holds no storage (its ``data.pkl`` only raises an error)."""
    if split:
        return StorageRefs({}, {})
    keys = {item.name: str(k) for k, item in enumerate(i for i in items if i.name != OBJECTS_ENTRY)}
    state_tensors = flat.tensors
    tensors: dict[int, TensorRef] = {}
    for item in items:
        if not item.members:  # pickled bytes: data.pkl holds those leaves itself
            continue
        held = [state_tensors[m.index][1] for m in item.members]
        dtype = held[0].dtype
        stype = storage_type(dtype)
        if stype is None or any(t.dtype != dtype for t in held):
            log.debug("state cannot be written in torch.save's zip layout (%s); writing safetensors only",
                      {t.dtype for t in held})
            return None
        size = held[0].element_size()
        if item.nbytes % size:
            return None
        ref = StorageRef(keys[item.name], stype, item.nbytes // size)
        for (_, offset, stride), t in zip(item.members, held):
            if offset % size:
                return None
            shape = tuple(t.shape)
            tensors[id(t)] = _new(TensorRef, (ref, offset // size, shape,
                                              stride if stride is not None else contiguous_strides(shape)))
    return StorageRefs(keys, tensors)


def lay_out(section: DataSection, items: list[Item], refs: StorageRefs, state: Any) -> bytes:
    """Place ``items`` in ``section`` as records of the archive ``state`` pickles to (its tensors named
    by ``refs``), close it with the archive's tail, and return the file's header: the local header
    of ``archive/.persist_header`` (padded to 4 KiB), then the safetensors header (its record's data)."""
    names = [None if key is None else record_name(key) for key in map(refs.keys.get, (item.name for item in items))]
    headers = [b"" if name is None else local_header(name, item.nbytes) for name, item in zip(names, items)]
    starts = section.place(items, headers)
    records = [Record(name, start - len(header), item.nbytes)  # header_at: relative to the data section
               for name, header, start, item in zip(names, headers, starts, items) if name is not None]
    data_pkl = pickle_state(state, refs.tensors)
    header_len, tail, header = 2 * PAGE_BYTES, b"", b""
    for _ in range(4):  # offsets in the tail are absolute; its length depends on them only past ZIP64's limits
        placed = [Record(HEADER_RECORD, 0, header_len - PAGE_BYTES),
                  *(Record(r.name, header_len + r.header_at, r.size) for r in records)]
        tail = zip_tail(placed, data_pkl, start=header_len + section.pos, align=PAGE_BYTES)
        st_header = section.header_with(TAIL_ENTRY, len(tail))
        header = header_record(len(st_header), PAGE_BYTES) + st_header
        if len(header) == header_len:
            break
        header_len = len(header)
    else:
        raise AssertionError("the shard header did not settle")
    section.append(TAIL_ENTRY, tail)
    return header
