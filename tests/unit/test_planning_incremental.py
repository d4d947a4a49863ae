"""The pure half of incremental saves (``planning/incremental.py``): which entries a save references, and the shard's
layout without them, made in place; and the retainer sparing what a staying checkpoint references."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from persist_core.format.manifest import Manifest
from persist_core.format.records import TensorRecord
from persist_core.format.shard_file import encode_header, parse_header
from persist_core.planning.incremental import compact, reference_unchanged
from persist_core.policies.retention import KeepLastN, Retainer
from tests.unit.test_retainer import FakeTier

H = {"a": "0" * 32, "b": "1" * 32, "c": "2" * 32}


def _rec(entry: str, *, step: int | None = None, digest: str | None = None, shape=(4,)) -> TensorRecord:
    return TensorRecord(dtype="float32", shape=shape, file="rank-00000.safetensors", entry=entry, step=step,
                        hash=digest)


def _previous(step: int, *records: TensorRecord) -> Manifest:
    return Manifest(step=step, time=0.0, world_size=1, tree={}, tensors=records, objects=(), files=())


NEW = (_rec("a"), _rec("b"), _rec("c"))


@pytest.mark.parametrize("previous, since_full, full_every, want_steps, dropped", [
    (None, 0, 10, [None, None, None], set()),  # the first save: full
    (_previous(5, _rec("a", digest=H["a"]), _rec("b", digest=H["b"]), _rec("c", digest="f" * 32)), 0, 10,
     [5, 5, None], {"a", "b"}),  # c changed
    (_previous(5, _rec("a", digest=H["a"]), _rec("b", digest=H["b"]), _rec("c", digest=H["c"])), 9, 10,
     [None, None, None], set()),  # the 10th save since the full one: full again
    (_previous(7, _rec("a", step=3, digest=H["a"]), _rec("b", digest=H["b"])), 1, 10,
     [3, 7, None], {"a", "b"}),  # depth 1: a is held by 3, not by 7 which references it
    (_previous(7, _rec("a", digest=H["a"], shape=(2, 2)), _rec("b", digest=H["b"])), 0, 10,
     [None, 7, None], {"b"}),  # same bytes, another shape: written
])
def test_which_entries_a_save_references(previous, since_full, full_every, want_steps, dropped):
    d = reference_unchanged(NEW, H, previous, since_full=since_full, full_every=full_every, max_span=3)
    assert [r.step for r in d.records] == want_steps
    assert d.dropped == dropped
    assert all(r.hash == H[r.entry] for r in d.records)  # every whole entry carries its hash, referenced or not


def test_references_spanning_more_than_max_span_checkpoints_make_a_full_save():
    prev = _previous(9, _rec("a", step=3, digest=H["a"]), _rec("b", step=5, digest=H["b"]), _rec("c", digest=H["c"]))
    assert reference_unchanged(NEW, H, prev, since_full=1, full_every=10, max_span=3).depends_on() == {3, 5, 9}
    assert reference_unchanged(NEW, H, prev, since_full=1, full_every=10, max_span=2).full
    gone = reference_unchanged(NEW, H, prev, since_full=1, full_every=10, max_span=3, missing=frozenset({3}))
    assert gone.depends_on() == {5, 9} and "a" not in gone.dropped  # a missing holder is never referenced


def test_compact_keeps_the_changed_entries_in_order_in_place_and_the_file_parses():
    names = [("x", 100), ("big", 5000), ("y", 64), ("z", 3)]
    entries, pos = {"__metadata__": {"format": "torch-persist"}}, 0
    data = bytearray()
    for i, (name, n) in enumerate(names):
        start = pos + -pos % 64
        if start != pos:
            entries[f"__pad__.{i}"] = {"dtype": "U8", "shape": [start - pos], "data_offsets": [pos, start]}
            data += bytes(start - pos)
        entries[name] = {"dtype": "U8", "shape": [n], "data_offsets": [start, start + n]}
        data += bytes([i + 1]) * n
        pos = start + n
    gap = -pos % 4096
    entries["__pad__.end"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
    header = encode_header(entries)
    buf = bytearray(header + data + bytes(gap))
    layout = compact(header, frozenset({"big"}))
    assert layout is not None and layout.file_bytes % 4096 == 0 and layout.file_bytes < len(buf)
    for src, dst, n in layout.moves:
        assert dst <= src
        buf[dst : dst + n] = buf[src : src + n]
    for b, e in layout.zeros:
        buf[b:e] = bytes(e - b)
    buf[: len(layout.header)] = layout.header
    out = bytes(buf[: layout.file_bytes])
    start, spans = parse_header(out, file_size=len(out))
    kept = {name: out[b:e] for name, b, e in spans if not name.startswith("__pad__")}
    assert kept == {"x": b"\x01" * 100, "y": b"\x03" * 64, "z": b"\x04" * 3}
    assert all(out[b:e] == bytes(e - b) for name, b, e in spans if name.startswith("__pad__"))
    (n,) = struct.unpack("<Q", out[:8])
    assert json.loads(out[8 : 8 + n])["__metadata__"] == {"format": "torch-persist"}
    assert torch.frombuffer(bytearray(kept["x"]), dtype=torch.uint8).eq(1).all()


def test_the_retainer_spares_what_a_staying_checkpoint_references():
    tier = FakeTier(1, 2, 3, 4, 5)
    deps = {3: {1}, 5: {2}}
    Retainer(tier, KeepLastN(2), references=lambda s: deps.get(s, set())).apply()
    assert sorted(tier.steps) == [2, 4, 5]  # 4 and 5 by the policy, 2 as 5 references it; 1 only by 3, which goes
