"""The shard layout and tree encoding, without threads or the engine."""

from __future__ import annotations

import struct
import threading

import pytest
import torch
from safetensors import safe_open

from persist_core import CheckpointEngine, UnsupportedStateError
from persist_core.format.tree import flatten
from persist_core.planning.save import plan_shard
from tests.support.states import assert_state_equal, awkward_state


def test_awkward_state_round_trips(ckpt_dir):
    state = awkward_state()
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state, step=1).wait()
        loaded = engine.load()
    assert_state_equal(state, loaded)


def test_views_keep_sharing_storage_after_load(ckpt_dir):
    base = torch.arange(24.0).reshape(4, 6)
    state = {"base": base, "rows": base[1:3], "t": base.t(), "tied": base}
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state, step=1).wait()
        out = engine.load()
    ptr = out["base"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == ptr for k in state)
    assert out["t"].stride() == base.t().stride()
    out["base"][1, 0] = -1.0  # one write shows through every alias, as in the saved state
    assert out["rows"][0, 0] == -1.0 and out["t"][0, 1] == -1.0 and out["tied"][1, 0] == -1.0


def test_shard_is_safetensors_with_a_page_aligned_data_section(ckpt_dir):
    state = {"w": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int16), "h": torch.randn(3).half()}
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state, step=3).wait()
    (shard,) = ckpt_dir.glob("step-*/rank-*.safetensors")
    raw = shard.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % 4096 == 0 and len(raw) % 4096 == 0
    with safe_open(str(shard), "pt") as f:
        for name, t in state.items():
            assert f.get_tensor(name).equal(t)


def test_unsaveable_leaf_names_its_key_path():
    lock = threading.Lock()
    with pytest.raises(UnsupportedStateError, match=r"state\['optim/hooks/1'\]"):
        flatten({"optim": {"hooks": [1, lock]}})


def test_sparse_tensor_is_refused_with_the_fix():
    with pytest.raises(UnsupportedStateError, match=r"to_dense"):
        flatten({"emb": torch.eye(3).to_sparse()})


def test_plan_entries_are_aligned_and_contiguous():
    flat = flatten({"a": torch.randn(3), "b": torch.randn(5, dtype=torch.float64), "c": torch.tensor(True)})
    plan = plan_shard(flat)
    assert plan.file_bytes % 4096 == 0 and len(plan.header) % 4096 == 0
    assert all(c.begin % 64 == 0 for c in plan.copies)
    assert [r.entry for r in plan.records] == ["a", "b", "c"]


def test_user_keys_cannot_collide_with_internal_entries(ckpt_dir):
    state = {"__pad__.0": torch.ones(2), "__objects__": torch.zeros(1), "x": ValueError("kept")}
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state, step=1).wait()
        out = engine.load(weights_only=False)  # an exception object is no training type: full pickle, opted in
    assert out["__pad__.0"].equal(torch.ones(2)) and out["__objects__"].equal(torch.zeros(1))
    assert type(out["x"]) is ValueError and out["x"].args == ("kept",)
