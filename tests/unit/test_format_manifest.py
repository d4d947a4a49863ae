"""The on-disk contract: a checkpoint is byte for byte the golden one of the current version, every older
version's golden checkpoint still loads, and no damage to a manifest ever loads different values."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from persist_core import CheckpointEngine, CheckpointReader, CorruptCheckpointError
from persist_core.format import FORMAT_VERSION, Manifest
from tests.support.golden import golden_state
from tests.support.states import assert_state_equal

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WALL = 1767225600.0  # the golden files' wall-clock time


def _place(root: Path, version: int, step: int = 12) -> Path:
    ckpt = root / f"step-{step:012d}"
    ckpt.mkdir(parents=True)
    shutil.copy(GOLDEN / f"v{version}-rank-00000.safetensors", ckpt / "rank-00000.safetensors")
    shutil.copy(GOLDEN / f"v{version}-manifest.json", ckpt / "manifest.json")
    return ckpt


def test_a_save_writes_the_golden_bytes_of_the_current_version(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    ckpt = tmp_path / "step-000000000012"
    assert FORMAT_VERSION == 2
    assert (ckpt / "manifest.json").read_bytes() == (GOLDEN / "v2-manifest.json").read_bytes()
    assert (ckpt / "rank-00000.safetensors").read_bytes() == (GOLDEN / "v2-rank-00000.safetensors").read_bytes()


def test_only_the_time_field_and_the_checksum_depend_on_the_clock(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL + 60) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    got = Manifest.from_bytes((tmp_path / "step-000000000012" / "manifest.json").read_bytes(), where="new")
    want = Manifest.from_bytes((GOLDEN / "v2-manifest.json").read_bytes(), where="golden")
    assert got.time == WALL + 60 and want.time == WALL
    assert Manifest(**{**got.__dict__, "time": WALL}).to_bytes() == want.to_bytes()


@pytest.mark.parametrize("version", [1, 2])
def test_every_versions_golden_checkpoint_loads(tmp_path, version):
    _place(tmp_path, version)
    with CheckpointReader(tmp_path) as reader:
        assert_state_equal(reader.load(), golden_state())


def test_a_manifest_that_does_not_match_its_checksum_is_corrupt_and_names_it(tmp_path):
    raw = bytearray((GOLDEN / "v2-manifest.json").read_bytes())
    raw[raw.index(b'"note":"golden"') + 8] ^= 0x01  # golden -> folden: still valid JSON, still a plausible value
    with pytest.raises(CorruptCheckpointError, match="does not match its own checksum"):
        Manifest.from_bytes(bytes(raw), where="m")
    stripped = raw[: raw.rindex(b',"manifest_crc32c"')] + b"}"
    with pytest.raises(CorruptCheckpointError, match="version 2 manifest without a checksum"):
        Manifest.from_bytes(bytes(stripped), where="m")
    newer = (GOLDEN / "v1-manifest.json").read_bytes().replace(b'"version":1', b'"version":9')
    with pytest.raises(CorruptCheckpointError, match="version 9.*upgrade torch-persist"):
        Manifest.from_bytes(newer, where="m")
