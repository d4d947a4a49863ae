"""The on-disk contract: a checkpoint is byte for byte the golden one of the current version, every older
version's golden checkpoint still loads, and no damage to a manifest ever loads different values."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader, CorruptCheckpointError
from persist_core.format import FORMAT_VERSION, Manifest
from tests.support.golden import golden_state
from tests.support.states import assert_state_equal

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WALL = 1767225600.0  # the golden files' wall-clock time


def _place(root: Path, version: str, step: int = 12) -> Path:
    ckpt = root / f"step-{step:012d}"
    ckpt.mkdir(parents=True)
    for golden in GOLDEN.glob(f"v{version}-*"):
        if golden.name.removeprefix(f"v{version}-").count("-") <= 1:  # v3-rank-00000.x, not v3-torch-rank-...
            shutil.copy(golden, ckpt / golden.name.removeprefix(f"v{version}-"))
    return ckpt


def _golden_lineage(raw: bytes, want: Manifest) -> bytes:
    """A manifest written here with the golden file's lineage (this machine's versions and git commit differ)."""
    got = Manifest.from_bytes(raw, where="new")
    assert got.lineage is not None and set(got.lineage) == set(want.lineage or {})
    return dataclasses.replace(got, lineage=want.lineage).to_bytes()


@pytest.mark.parametrize("torch_loadable, prefix, shard", [(False, "v7-", "rank-00000.safetensors"),
                                                           (True, "v7-torch-", "rank-00000.ckpt")])
def test_a_save_writes_the_golden_bytes_of_the_current_version(tmp_path, torch_loadable, prefix, shard):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL,
                          torch_loadable=torch_loadable) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    ckpt = tmp_path / "step-000000000012"
    assert FORMAT_VERSION == 5  # shards are unchanged since version 5; manifests are version 7
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", shard]
    want = (GOLDEN / f"{prefix}manifest.json").read_bytes()
    assert Manifest.from_bytes(want, where="golden").version == 7
    assert _golden_lineage((ckpt / "manifest.json").read_bytes(), Manifest.from_bytes(want, where="g")) == want
    assert (ckpt / shard).read_bytes() == (GOLDEN / f"{prefix}{shard}").read_bytes()


def test_only_the_time_field_and_the_checksum_depend_on_the_clock(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL + 60) as engine:
        engine.save(golden_state(), step=12, metadata={"note": "golden"}).wait()
    got = Manifest.from_bytes((tmp_path / "step-000000000012" / "manifest.json").read_bytes(), where="new")
    want = Manifest.from_bytes((GOLDEN / "v7-manifest.json").read_bytes(), where="golden")
    assert got.time == WALL + 60 and want.time == WALL
    assert Manifest(**{**got.__dict__, "time": WALL, "lineage": want.lineage}).to_bytes() == want.to_bytes()


@pytest.mark.parametrize("version", ["1", "2", "3", "3-torch", "4", "4-torch", "5", "5-torch", "7", "7-torch"])
def test_every_versions_golden_checkpoint_loads(tmp_path, version):
    ckpt = _place(tmp_path, version)
    with CheckpointReader(tmp_path) as reader:
        assert_state_equal(reader.load(), golden_state())
    if version.endswith("-torch"):  # and torch.load reads it too
        assert_state_equal(torch.load(ckpt / "rank-00000.ckpt", weights_only=False), golden_state())


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


@pytest.mark.parametrize("nodes, node, problem", [([[0], [2]], 0, "do not split"), ([[0, 1]], 3, "not one of"),
                                                  ([[0], [1]], True, "not one of"), ([], 0, "not one of")])
def test_a_node_placement_that_does_not_fit_its_ranks_is_corrupt(nodes, node, problem):
    import dataclasses

    from persist_core.format.manifest import FileEntry

    files = (FileEntry("rank-00000.safetensors", 0, 4, "crc32c", 4, (1,)),
             FileEntry("rank-00001.safetensors", 1, 4, "crc32c", 4, (1,)))
    good = Manifest(step=1, time=0.0, world_size=2, tree={"value": 1}, tensors=(), objects=(), files=files,
                    nodes=((0,), (1,)), node=1)
    parsed = Manifest.from_bytes(good.to_bytes(), where="m")
    assert [f.name for f in parsed.held()] == ["rank-00001.safetensors"]
    assert [f.name for f in parsed.elsewhere()] == ["rank-00000.safetensors"]
    assert parsed.placed(None).held() == files
    bad = dataclasses.replace(good, nodes=tuple(tuple(n) for n in nodes), node=node)
    with pytest.raises(CorruptCheckpointError, match=problem):
        Manifest.from_bytes(bad.to_bytes(), where="m")


def test_a_chunk_can_name_another_checkpoints_bytes_only_from_version_6():
    """The seam of incremental saves (issue 43): a chunk record names the checkpoint holding its bytes, the manifest
    says which checkpoints it depends on, and no version-5 manifest may carry such a reference."""
    from persist_core.errors import CorruptCheckpointError
    from persist_core.format.records import Chunk, TensorRecord

    chunk = Chunk(file="rank-00000.safetensors", entry="w", offsets=(0,), sizes=(4,), step=30, hash="0" * 32)
    record = TensorRecord(dtype="float32", shape=(4,), placements="(Shard(dim=0),)", mesh=(1,), chunks=(chunk,))
    raw = record.to_json()
    assert raw["chunks"][0]["step"] == 30 and raw["chunks"][0]["hash"] == "0" * 32
    assert TensorRecord.parse(raw, 0, "m", version=6) == record
    unproven = {**raw, "chunks": [{k: v for k, v in raw["chunks"][0].items() if k != "hash"}]}
    with pytest.raises(CorruptCheckpointError, match="referencing step 30 without the hash"):
        TensorRecord.parse(unproven, 0, "m", version=6)
    with pytest.raises(CorruptCheckpointError, match="naming step 30.*version 6 on, this manifest is 5"):
        TensorRecord.parse(raw, 0, "m", version=5)
    own = Chunk(file="rank-00000.safetensors", entry="w", offsets=(0,), sizes=(4,))
    assert "step" not in own.to_json()  # a chunk of this checkpoint's own: the JSON of version 5, unchanged
    from persist_core.format.manifest import Manifest

    def manifest(*chunks: Chunk) -> Manifest:
        rec = TensorRecord(dtype="float32", shape=(4,), placements="(Shard(dim=0),)", mesh=(1,), chunks=chunks)
        return Manifest(step=40, time=0.0, world_size=1, tree={"tensor": 0}, tensors=(rec,), objects=(), files=())

    assert manifest(chunk).depends_on() == {30} and manifest(own).depends_on() == set()



def test_chunks_that_do_not_tile_a_tensor_are_a_rank_s_memory_snapshot_or_corrupt():
    from persist_core.format.manifest import Manifest
    from persist_core.format.records import Chunk, TensorRecord

    half = Chunk(file="rank-00000.safetensors", entry="w", offsets=(2,), sizes=(2,))
    rec = TensorRecord(dtype="float32", shape=(4,), placements="(Shard(dim=0),)", mesh=(2,), chunks=(half,))
    from persist_core.fileio import CHECKSUM_ALGORITHM
    from persist_core.format.manifest import FileEntry

    file = FileEntry(name="rank-00000.safetensors", rank=0, size=4096, checksum=CHECKSUM_ALGORITHM, chunk_bytes=4096,
                     chunks=(0,))
    disk = Manifest(step=3, time=0.0, world_size=1, tree={"tensor": 0}, tensors=(rec,), objects=(), files=(file,))
    assert b'"part"' not in disk.to_bytes()  # every checkpoint on disk: the JSON as before
    with pytest.raises(CorruptCheckpointError, match="do not cover its 4 elements"):
        Manifest.from_bytes(disk.to_bytes(), where="m")
    snapshot = Manifest.from_bytes(dataclasses.replace(disk, part=1).to_bytes(), where="m")
    assert snapshot.part == 1 and snapshot.tensors[0].chunks == (half,)
    with pytest.raises(CorruptCheckpointError, match="is not a rank"):
        Manifest.from_bytes(dataclasses.replace(disk, part=-1).to_bytes(), where="m")

def _incremental_pair(root: Path) -> None:
    """The golden files of version 6 (issue 43): the golden state saved full at step 11, then at step 12 with
    ``model.weight`` changed, incrementally (step 12 references the rest in step 11)."""
    with CheckpointEngine(root, direct_io="off", chunk_bytes=4096 * 4, wall_clock=lambda: WALL,
                          incremental=True) as engine:
        engine.save(golden_state(), step=11, metadata={"note": "golden"}).wait()
        engine.save(_changed(), step=12, metadata={"note": "golden"}).wait()


def _changed() -> dict:
    state = golden_state()
    state["model"]["weight"] += 1
    return state


def test_an_incremental_save_writes_the_golden_bytes_of_version_6(tmp_path):
    _incremental_pair(tmp_path)
    for step, prefix in ((11, "v6-full-"), (12, "v6-")):
        ckpt = tmp_path / f"step-{step:012d}"
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "rank-00000.safetensors"]
        got = Manifest.from_bytes((ckpt / "manifest.json").read_bytes(), where="new")
        assert got.version == 7 and all(t.digest is not None for t in got.tensors if t.step is None)
        # without what version 7 adds (digests, lineage) it is byte for byte the version-6 golden manifest
        older = dataclasses.replace(got, lineage=None, tensors=tuple(dataclasses.replace(t, digest=None)
                                                                      for t in got.tensors))
        assert older.to_bytes() == (GOLDEN / f"{prefix}manifest.json").read_bytes()
        assert (ckpt / "rank-00000.safetensors").read_bytes() == (GOLDEN / f"{prefix}rank-00000.safetensors").read_bytes()
    assert Manifest.from_bytes((GOLDEN / "v6-full-manifest.json").read_bytes(), where="g").version == 5
    assert Manifest.from_bytes((GOLDEN / "v6-manifest.json").read_bytes(), where="g").depends_on() == {11}


def test_the_golden_checkpoints_of_version_6_load(tmp_path):
    for step, prefix in ((11, "v6-full-"), (12, "v6-")):
        ckpt = tmp_path / f"step-{step:012d}"
        ckpt.mkdir()
        shutil.copy(GOLDEN / f"{prefix}manifest.json", ckpt / "manifest.json")
        shutil.copy(GOLDEN / f"{prefix}rank-00000.safetensors", ckpt / "rank-00000.safetensors")
    with CheckpointReader(tmp_path) as reader:
        assert_state_equal(reader.load(step=11), golden_state())
        assert_state_equal(reader.load(), _changed())
