"""The on-disk contract: a v1 checkpoint is byte for byte what the engine wrote before the restructuring,
and a v1 checkpoint written then still loads."""

from __future__ import annotations

import shutil
from pathlib import Path

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.format import Manifest
from tests.support.golden import golden_state
from tests.support.states import assert_state_equal

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WALL = 1767225600.0  # the golden files' wall-clock time


def test_a_save_writes_the_golden_bytes_apart_from_nothing(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    ckpt = tmp_path / "step-000000000012"
    assert (ckpt / "manifest.json").read_bytes() == (GOLDEN / "v1-manifest.json").read_bytes()
    assert (ckpt / "rank-00000.safetensors").read_bytes() == (GOLDEN / "v1-rank-00000.safetensors").read_bytes()


def test_only_the_time_field_depends_on_the_clock(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL + 60) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    got = Manifest.from_bytes((tmp_path / "step-000000000012" / "manifest.json").read_bytes(), where="new")
    want = Manifest.from_bytes((GOLDEN / "v1-manifest.json").read_bytes(), where="golden")
    assert got.time == WALL + 60 and want.time == WALL
    assert got.to_bytes().replace(b'"time":1767225660.0', b'"time":1767225600.0') == want.to_bytes()


def test_the_golden_v1_checkpoint_loads(tmp_path):
    ckpt = tmp_path / "step-000000000012"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "v1-rank-00000.safetensors", ckpt / "rank-00000.safetensors")
    shutil.copy(GOLDEN / "v1-manifest.json", ckpt / "manifest.json")
    with CheckpointReader(tmp_path) as reader:
        assert_state_equal(reader.load(), golden_state())
