"""What planning makes of each kind of leaf (planning/items.py), where the items go (planning/section.py), and
the torch-loadable pass (planning/torch_loadable.py): offsets, alignment, records. Pure functions, no files."""

from __future__ import annotations

import io
import json
import pickle
import struct

import pytest
import torch

from persist_core.format.records import TensorRecord
from persist_core.format.shard_file import OBJECTS_ENTRY, PER_RANK_ENTRY
from persist_core.format.torch_zip import SplitShard, local_header, record_name
from persist_core.format.tree import PerRank, flatten
from persist_core.planning.items import (BlobSlot, EntryNames, Member, SpanSlot, blob_item, dtensor_item,
                                         plain_item, plan_items, records, shared_item, spans)
from persist_core.planning.partition import storage_groups
from persist_core.planning.section import DataSection
from persist_core.planning.sharding import Sharding
from persist_core.planning.torch_loadable import TAIL_ENTRY, lay_out, storage_refs


def _index(flat, path: str) -> int:
    return [p for p, _ in flat.tensors].index(path)


def _sharding(writes: bool) -> Sharding:
    return Sharding((4, 3), (0, 0), (2, 3), writes, "(Shard(dim=0),)", (2,))


# ------------------------------------------------------------------ one function per kind of leaf


def test_a_plain_tensor_is_an_entry_of_its_dtype_and_shape_holding_it_from_offset_0():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    flat = flatten({"a": torch.ones(1), "w": t})
    item = plain_item(flat, 1, EntryNames())
    assert (item.name, item.dtype, item.shape, item.nbytes) == ("w", "I16", (2, 3), 12)
    assert item.source is t and (item.view, item.view_shape) == (torch.int16, (2, 3))
    assert item.slot == Member(1) and item.slot.take(flat) is t
    assert item.members == (Member(1, 0, None),)


def test_a_plain_tensor_of_a_dtype_safetensors_does_not_name_is_an_entry_of_its_bytes():
    t = torch.ones(3, dtype=torch.complex64)
    item = plain_item(flatten({"c": t}), 0, EntryNames())
    assert (item.dtype, item.shape, item.nbytes) == ("U8", (24,), 24)
    assert (item.view, item.view_shape) == (torch.complex64, (3,))  # the copy still reads it as itself


def test_entry_names_are_given_once_and_user_keys_never_take_an_internal_name():
    names = EntryNames()
    assert [names.take(p) for p in ("w", "w", "w", "", "__pad__.0", "__objects__")] == \
        ["w", "w#1", "w#2", "<root>", "___pad__.0", "___objects__"]
    assert names.take("__shared__.0", internal=True) == "__shared__.0"


def test_tensors_sharing_a_storage_are_one_entry_of_the_bytes_they_span_from_an_aligned_start():
    base = torch.arange(64, dtype=torch.float32)  # 256 bytes
    flat = flatten({"x": torch.ones(1), "rows": base[20:30], "strided": base[40:60:2]})
    (group,) = [g for g in storage_groups(flat) if len(g) > 1]
    item = shared_item(flat, group, 1, EntryNames())
    # the first byte used is 80 (element 20): the entry starts at 64, the byte at or before it on a 64-byte
    # boundary of the storage; it ends with the last byte used (element 58: byte 236)
    assert item.slot == SpanSlot(group[0], 64, 236 - 64)
    assert (item.name, item.dtype, item.shape, item.nbytes) == ("__shared__.1", "U8", (172,), 172)
    assert item.members == (Member(group[0], 80 - 64, (1,)), Member(group[1], 160 - 64, (2,)))
    assert bytes(item.source.numpy()) == bytes(base.view(torch.uint8)[64:236].numpy())
    rows, strided = (records(flat, [item], "f")[i] for i in group)
    assert rows == TensorRecord(dtype="float32", shape=(10,), file="f", entry="__shared__.1", stride=(1,), offset=16,
                                replicated=True)
    assert strided == TensorRecord(dtype="float32", shape=(10,), file="f", entry="__shared__.1", stride=(2,),
                                   offset=96, replicated=True)


def test_a_span_slot_takes_the_same_bytes_from_the_next_state_of_the_same_structure():
    base = torch.arange(32, dtype=torch.float32)
    flat = flatten({"a": base[1:5], "b": base[10:20]})
    item = shared_item(flat, storage_groups(flat)[0], 0, EntryNames())
    other = torch.arange(100, 132, dtype=torch.float32)
    again = item.slot.take(flatten({"a": other[1:5], "b": other[10:20]}))
    assert bytes(again.numpy()) == bytes(other.view(torch.uint8)[:80].numpy())


def test_a_dtensor_part_is_a_plain_entry_on_the_replica_that_writes_it_and_nothing_elsewhere():
    flat = flatten({"w": torch.ones(2, 3), "v": torch.zeros(2)})
    names = EntryNames()
    assert dtensor_item(flat, 0, _sharding(writes=False), names) is None
    assert names.take("w") == "w"  # no name was taken for it
    part = dtensor_item(flat, 0, _sharding(writes=True), EntryNames())
    assert part == plain_item(flat, 0, EntryNames())
    assert records(flat, [part], "f") == [TensorRecord(dtype="float32", shape=(2, 3), file="f", entry="w",
                                                       replicated=True), None]


@pytest.mark.parametrize("per_rank", [False, True])
def test_pickled_leaves_are_one_entry_of_their_bytes_joined(per_rank):
    flat = flatten({"a": "x", "b": PerRank([1, 2]), "c": {3, 4}, "d": PerRank(b"z")})
    blobs = flat.per_rank if per_rank else flat.objects
    item = blob_item(flat, per_rank=per_rank)
    assert item.name == (PER_RANK_ENTRY if per_rank else OBJECTS_ENTRY) and item.source == b"".join(blobs)
    assert (item.dtype, item.shape, item.nbytes, item.view) == ("U8", (len(item.source),), len(item.source), torch.uint8)
    assert item.slot == BlobSlot(per_rank) and item.members == ()
    assert [pickle.loads(item.source[b:b + n]) for b, n in spans(blobs)] == [pickle.loads(b) for b in blobs]


def test_the_items_of_a_shard_come_in_file_order_and_each_rank_has_its_own():
    base = torch.arange(8.0)
    state = {"a": torch.ones(3), "t1": base[:2], "t2": base[4:], "b": torch.zeros(2), "d": torch.ones(4, 3),
             "obj": {1, 2}, "r": PerRank(1)}
    flat = flatten(state)
    d = _index(flat, "d")
    groups = storage_groups(flat, skip={d})
    assert [it.name for it in plan_items(flat, groups, None, 0, {d: _sharding(True)})] == \
        ["a", "__shared__.1", "b", "d", PER_RANK_ENTRY, OBJECTS_ENTRY]
    owners = [1, 0, 1]  # group 1 (the shared one) to rank 0, the others to rank 1
    assert [it.name for it in plan_items(flat, groups, owners, 0, {d: _sharding(False)})] == \
        ["__shared__.1", PER_RANK_ENTRY, OBJECTS_ENTRY]
    assert [it.name for it in plan_items(flat, groups, owners, 1, {d: _sharding(True)})] == \
        ["a", "b", "d", PER_RANK_ENTRY]  # the pickled leaves only on rank 0
    recs = records(flat, plan_items(flat, groups, owners, 1, {}), "f")
    assert [r and r.entry for r in recs] == ["a", None, None, "b", None]  # what others write: None


# ------------------------------------------------------------------ where the items go


def test_items_start_on_64_bytes_the_gaps_are_pad_entries_and_the_section_ends_on_4_kib():
    flat = flatten({"a": torch.ones(3), "e": torch.empty(0), "b": torch.ones(16), "c": torch.ones(1, dtype=torch.int8)})
    items = plan_items(flat, storage_groups(flat), None, 0, {})
    section = DataSection()
    assert section.place(items) == [0, 64, 64, 128]
    assert section.pos == 129
    header = section.close()
    assert section.pos == 4096 and len(header) % 4096 == 0
    (n,) = struct.unpack("<Q", header[:8])
    entries = json.loads(header[8:8 + n])
    assert entries["a"]["data_offsets"] == [0, 12] and entries["__pad__.0"]["data_offsets"] == [12, 64]
    assert entries["e"]["data_offsets"] == [64, 64] and entries["b"]["data_offsets"] == [64, 128]
    assert entries["__pad__.1"]["data_offsets"] == [129, 4096]  # the last pad: to 4 KiB
    assert [(c.begin, c.end, c.name) for c in section.copies] == [(0, 12, "a"), (64, 128, "b"), (128, 129, "c")]
    assert section.slots == [Member(0), Member(2), Member(3)]  # an empty tensor has no copy


def test_a_local_header_ends_the_pad_before_its_item_and_pushes_it_on_when_the_pad_is_short():
    flat = flatten({"a": torch.ones(3), "b": torch.ones(2)})
    items = plan_items(flat, storage_groups(flat), None, 0, {})
    h0, h1 = local_header(record_name("0"), 12), local_header(record_name("1"), 8)
    section = DataSection()
    starts = section.place(items, [h0, h1])
    assert starts == [64, 128]  # a 44-byte header does not fit before a (0 bytes of pad) nor b (52 after a's 12)
    pads = [c for c, s in zip(section.copies, section.slots) if s is None]
    assert [(c.begin, c.end) for c in pads] == [(0, 64), (76, 128)]
    assert all(c.source.endswith(h) and not c.source[:-len(h)].strip(b"\0") for c, h in zip(pads, (h0, h1)))


# ------------------------------------------------------------------ the torch-loadable pass


def _file(header: bytes, section: DataSection) -> bytes:
    data = bytearray(section.pos)
    for c in section.copies:
        src = c.source if isinstance(c.source, bytes) else bytes(c.source.contiguous().view(-1).view(torch.uint8).numpy())
        data[c.begin:c.end] = src
    return header + bytes(data)


def test_the_torch_loadable_pass_makes_each_item_a_storage_record_that_torch_load_reads():
    base = torch.arange(12.0).reshape(3, 4)
    state = {"w": torch.randn(5, 3), "tied": base, "view": base.t()[1:], "n": 3, "name": "x"}
    flat = flatten(state)
    items = plan_items(flat, storage_groups(flat), None, 0, {})
    refs = storage_refs(flat, items)
    assert refs is not None and refs.keys == {"w": "0", "__shared__.1": "1"}  # no record for the pickled leaves
    view = refs.tensors[id(flat.tensors[_index(flat, "view")][1])]
    assert (view.storage.key, view.offset, view.shape, view.stride) == ("1", 1, (3, 3), (1, 4))  # elements
    section = DataSection()
    header = lay_out(section, items, refs, state)
    assert len(header) % 4096 == 0 and (len(header) + section.pos) % 4096 == 0
    assert TAIL_ENTRY in section.entries and all(c.begin % 64 == 0 for c in section.copies if c.name)
    loaded = torch.load(io.BytesIO(_file(header, section)), weights_only=True)
    assert loaded.keys() == state.keys() and loaded["n"] == 3 and loaded["name"] == "x"
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["view"], state["view"])
    assert loaded["view"].untyped_storage().data_ptr() == loaded["tied"].untyped_storage().data_ptr()


def _two_views() -> dict:
    a = torch.arange(4, dtype=torch.int16)
    return {"a": a, "b": a.view(torch.int8)}


@pytest.mark.parametrize("make", [lambda: {"c": torch.ones(2, dtype=torch.uint32)}, _two_views],
                         ids=["a dtype without a torch storage type", "one storage viewed as two dtypes"])
def test_a_state_torch_format_cannot_say_has_no_storage_refs(make):
    flat = flatten(make())
    assert storage_refs(flat, plan_items(flat, storage_groups(flat), None, 0, {})) is None


def test_rank_0s_archive_of_a_split_state_holds_no_storage_and_says_how_to_load_it():
    flat = flatten({"w": torch.ones(3), "n": 1})
    items = plan_items(flat, storage_groups(flat), [0], 0, {})
    refs = storage_refs(flat, items, split=True)
    assert refs is not None and refs.keys == {} and refs.tensors == {}
    section = DataSection()
    header = lay_out(section, items, refs, SplitShard(2))
    assert section.copies[0].begin == 0  # no local header before the tensor: it is no record of the archive
    with pytest.raises(Exception, match="split across 2 ranks"):
        torch.load(io.BytesIO(_file(header, section)), weights_only=False)
