"""Single-writer shards that ``torch.load`` reads too (``torch_loadable``): the zip records inside our layout."""

from __future__ import annotations

import zipfile
from collections import OrderedDict

import pytest
import torch

import persist_core.format.torch_zip as torch_zip
from persist_core import CheckpointEngine, CheckpointReader, CorruptCheckpointError
from tests.support.states import assert_state_equal


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 10, generator=g)
    return {"model": OrderedDict(w=torch.randn(300, 300, generator=g), b=torch.arange(7),
                                 h=torch.ones(3, dtype=torch.bfloat16), e=torch.empty(0)),
            "tied": [base, base[2:5], base.t()], "lr": 0.1, "name": "run", "betas": (0.9, 0.99), "step": 4}


def save(tmp_path, s: dict, **kwargs) -> object:
    with CheckpointEngine(tmp_path / "ckpt", torch_loadable=True, **kwargs) as engine:
        engine.save(s, step=4)
    return tmp_path / "ckpt" / "step-000000000004"


@pytest.mark.parametrize("options", [{}, {"mmap": True}, {"weights_only": False}])
def test_torch_load_reads_the_shard_and_so_does_our_reader(tmp_path, options):
    s = state()
    ckpt = save(tmp_path, s)
    plain = torch.load(ckpt / "rank-00000.ckpt", **options)
    assert_state_equal(plain, s)
    assert plain["tied"][1].untyped_storage().data_ptr() == plain["tied"][0].untyped_storage().data_ptr()  # still tied
    assert_state_equal(CheckpointReader(tmp_path / "ckpt").load(4), s)


def test_zip64_past_the_4_gib_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_zip, "_ZIP64_LIMIT", 1000)  # every offset and size past it needs ZIP64 fields
    s = state()
    ckpt = save(tmp_path, s)
    assert_state_equal(torch.load(ckpt / "rank-00000.ckpt", mmap=True), s)
    names = {i.filename: i for i in zipfile.ZipFile(ckpt / "rank-00000.ckpt").infolist()}  # a second zip reader
    big = [i for i in names.values() if i.file_size == 300 * 300 * 4]
    assert len(big) == 1 and big[0].header_offset > 1000 and big[0].filename.startswith("archive/data/")


def test_torch_load_does_not_verify_but_our_load_does(tmp_path):
    ckpt = save(tmp_path, state())
    shard = ckpt / "rank-00000.ckpt"
    raw = bytearray(shard.read_bytes())
    at = raw.index(state()["model"]["w"].numpy().tobytes()[:64]) + 100
    raw[at] ^= 0xFF
    shard.write_bytes(raw)
    torch.load(shard)  # unverified: a zip's CRC-32 is never checked
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(tmp_path / "ckpt").load(4)


def test_without_the_option_or_with_a_state_torch_cannot_name_the_shard_stays_safetensors(tmp_path):
    with CheckpointEngine(tmp_path / "a") as engine:
        engine.save({"w": torch.ones(4)}, step=1)
    assert [p.name for p in (tmp_path / "a" / "step-000000000001").glob("rank-*")] == ["rank-00000.safetensors"]
    base = torch.arange(8, dtype=torch.float32)
    ckpt = save(tmp_path, {"a": base, "b": base.view(torch.int32)})  # one storage seen as two dtypes
    assert [p.name for p in ckpt.glob("rank-*")] == ["rank-00000.safetensors"]
    loaded = CheckpointReader(tmp_path / "ckpt").load(4)
    assert loaded["b"].equal(base.view(torch.int32))
