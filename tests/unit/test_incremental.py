"""Incremental saves on the local tier (issue 43, step a): what did not change since the newest committed checkpoint
is referenced, not written again; every step loads bit-exact, every byte verified; a full checkpoint comes every
``full_every`` saves; retention keeps what a kept checkpoint references; a corrupt referenced file makes its
dependents corrupt and the load falls back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from persist_core import (CheckpointEngine, CheckpointReader, ConfigError, CorruptCheckpointError, KeepLastN,
                          PersistError)
from persist_core.format.manifest import Manifest
from tests.support.states import assert_state_equal

BASE = 1 << 19  # float32 elements of the frozen base: 2 MiB
SHARD = "rank-00000.safetensors"


def _state(step: int, base: torch.Tensor) -> dict:
    """A frozen base and a small trainable adapter with Adam-like state, the adapter's bytes saying the step."""
    g = torch.Generator().manual_seed(step)
    adapter = torch.randn(64, 16, generator=g)
    encoder = torch.arange(1 << 16, dtype=torch.float64)  # frozen, alone in its storage: a plain entry
    return {"model": {"base.weight": base, "tied": base[:8], "encoder": encoder, "adapter": adapter},
            "optim": {"exp_avg": adapter * 0.1, "exp_avg_sq": adapter * adapter, "lr": 1e-3}, "step": step}


def _frozen() -> torch.Tensor:
    return torch.randn(BASE, generator=torch.Generator().manual_seed(1234))


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.from_bytes((_ckpt(root, step) / "manifest.json").read_bytes(), where="m")


def _shard_bytes(root: Path, step: int) -> int:
    return (_ckpt(root, step) / SHARD).stat().st_size


def _engine(root: Path, **options) -> CheckpointEngine:
    return CheckpointEngine(root, incremental=True, direct_io="off", **options)


def test_unchanged_tensors_are_referenced_every_step_loads_bit_exact_and_a_full_save_comes_every_full_every(tmp_path):
    base = _frozen()
    states = {step: _state(step, base) for step in range(1, 8)}
    with _engine(tmp_path, full_every=4) as engine:
        for step, state in states.items():
            engine.save(state, step=step).wait()
        for step, state in states.items():
            assert_state_equal(engine.load(step=step), state)
    full = {1, 5}  # the first, then every 4th save
    for step in states:
        m = _manifest(tmp_path, step)
        if step in full:
            assert _shard_bytes(tmp_path, step) > 4 * BASE
            assert m.depends_on() == set()
            assert json.loads((_ckpt(tmp_path, step) / "manifest.json").read_bytes())["version"] == 7  # digests
        else:  # the adapter, its optimizer state and the pickled leaves, the header: far below the base
            assert _shard_bytes(tmp_path, step) < 64 * 1024, step
            assert m.depends_on() == {1 if step < 5 else 5}
            assert json.loads((_ckpt(tmp_path, step) / "manifest.json").read_bytes())["version"] == 7
    with CheckpointReader(tmp_path) as reader:  # a fresh reader, whole and into targets
        for step, state in states.items():
            assert_state_equal(reader.load(step=step), state)
        into = _state(0, torch.zeros(BASE))
        into["model"]["tied"] = torch.zeros(8)
        into["model"]["encoder"] = torch.zeros(1 << 16, dtype=torch.float64)
        loaded = reader.load(step=3, into=into)
        assert_state_equal(loaded, states[3])
        assert loaded["model"]["base.weight"] is into["model"]["base.weight"]
        assert reader.last_load.needed_bytes < reader.last_load.read_bytes + 1  # each byte read once
        assert reader.last_load.read_bytes < 4 * BASE + 8 * (1 << 16) + 4 * (256 << 10) + 64 * 1024


def test_aliasing_survives_a_referencing_checkpoint(tmp_path):
    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    loaded = CheckpointReader(tmp_path).load(step=2)
    tied, full = loaded["model"]["tied"], loaded["model"]["base.weight"]
    assert tied.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_change_that_bumps_no_version_counter_is_written(tmp_path, how):
    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        version = base._version
        if how == "data":
            base.data[7] = 42.0
        else:
            base.numpy()[7] = 42.0
        assert base._version == version
        engine.save(_state(2, base), step=2).wait()
        assert _shard_bytes(tmp_path, 2) > 4 * BASE
        assert_state_equal(engine.load(step=2), _state(2, base))
        assert engine.load(step=2)["model"]["base.weight"][7] == 42.0


def test_a_restarted_engine_references_the_newest_committed_checkpoint(tmp_path):
    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
    with _engine(tmp_path) as engine:
        engine.load()
        engine.save(_state(2, base), step=2).wait()
        engine.save(_state(3, base), step=3).wait()
    assert _shard_bytes(tmp_path, 2) < 64 * 1024 and _shard_bytes(tmp_path, 3) < 64 * 1024
    assert _manifest(tmp_path, 3).depends_on() == {1}  # depth 1: the checkpoint holding the bytes
    assert_state_equal(CheckpointReader(tmp_path).load(), _state(3, base))


def test_retention_keeps_what_a_kept_checkpoint_references(tmp_path):
    base = _frozen()
    with _engine(tmp_path, full_every=3, keep_local=KeepLastN(1)) as engine:
        for step in (1, 2, 3):
            engine.save(_state(step, base), step=step).wait()
        assert [c.step for c in engine.list()] == [1, 3]  # 1 is referenced by 3 (counted by no keep_last)
        engine.save(_state(4, base), step=4).wait()  # full
        assert [c.step for c in engine.list()] == [4]
        engine.save(_state(5, base), step=5).wait()
        assert [c.step for c in engine.list()] == [4, 5]
        assert_state_equal(engine.load(), _state(5, base))


def test_a_corrupt_referenced_file_makes_its_dependents_corrupt_and_the_load_falls_back(tmp_path):
    base = _frozen()
    with _engine(tmp_path, full_every=2) as engine:
        for step in (1, 2, 3, 4):  # 1 full, 2 -> 1, 3 full, 4 -> 3
            engine.save(_state(step, base), step=step).wait()
    assert _manifest(tmp_path, 4).depends_on() == {3}
    shard = _ckpt(tmp_path, 3) / SHARD
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # in the base's bytes, which step 4 references
    shard.write_bytes(bytes(raw))
    with CheckpointReader(tmp_path) as reader:
        with pytest.raises(CorruptCheckpointError):
            reader.load(step=4)
        assert_state_equal(reader.load(), _state(2, base))
        assert reader.loaded_step == 2


def test_a_missing_referenced_checkpoint_makes_its_dependent_corrupt(tmp_path):
    import shutil

    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    shutil.rmtree(_ckpt(tmp_path, 1))
    with pytest.raises(CorruptCheckpointError, match="step 1"):
        CheckpointReader(tmp_path).load(step=2)


def test_incremental_is_off_by_default_and_writes_no_hashes(tmp_path):
    base = _frozen()
    with CheckpointEngine(tmp_path, direct_io="off") as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    assert _shard_bytes(tmp_path, 2) > 4 * BASE
    assert b'"hash"' not in (_ckpt(tmp_path, 2) / "manifest.json").read_bytes()


@pytest.mark.parametrize("options, match", [
    ({"full_every": 0}, "full_every=0"),
    ({"full_every": 2.5}, "full_every=2.5"),
    ({"full_every": True}, "full_every=True"),
    ({"incremental": "yes"}, "incremental='yes'"),
])
def test_what_incremental_does_not_take_is_a_config_error_naming_the_value(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointEngine(tmp_path, **options)


def test_a_referencing_shard_is_a_safetensors_file_of_the_changed_tensors_only(tmp_path):
    from safetensors import safe_open

    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    with safe_open(str(_ckpt(tmp_path, 2) / SHARD), framework="pt") as f:
        names = {k for k in f.keys() if not k.startswith("__pad__")}
        assert names == {"model/adapter", "optim/exp_avg", "optim/exp_avg_sq"}
        assert f.get_tensor("model/adapter").equal(_state(2, base)["model"]["adapter"])


def test_torch_loadable_full_checkpoints_stay_zip_archives_and_referencing_ones_hold_the_changes_only(tmp_path):
    """The Lightning plugin's layout: a full checkpoint is the archive torch.load reads; a referencing one is the
    staged archive compacted to what changed, still a zip archive whose data.pkl makes torch.load fail naming what it
    is (issue 53), loaded bit-exact by us."""
    from persist_core.format.shard_file import parse_header
    from persist_core.planning.torch_loadable import TAIL_ENTRY

    base = _frozen()
    states = {step: _state(step, base) for step in (1, 2, 3)}
    with _engine(tmp_path, torch_loadable=True, full_every=3) as engine:
        for step, state in states.items():
            engine.save(state, step=step).wait()
        for step, state in states.items():
            assert_state_equal(engine.load(step=step), state)
    ckpt = "rank-00000.ckpt"
    assert_state_equal(torch.load(_ckpt(tmp_path, 1) / ckpt, weights_only=True), states[1])
    assert _manifest(tmp_path, 2).depends_on() == {1} == _manifest(tmp_path, 3).depends_on()
    full = (_ckpt(tmp_path, 1) / ckpt).stat().st_size
    for step in (2, 3):
        path = _ckpt(tmp_path, step) / ckpt
        raw = path.read_bytes()
        assert len(raw) < full / 4 and len(raw) % 4096 == 0
        names = {name for name, _, _ in parse_header(raw, file_size=len(raw))[1]}
        assert {n for n in names if not n.startswith("__pad__")} == {"model/adapter", "optim/exp_avg",
                                                                     "optim/exp_avg_sq"} and TAIL_ENTRY in names
        with pytest.raises(PersistError, match=f"incremental checkpoint step {step}'s.*step 1"):
            torch.load(path, weights_only=False)


def test_a_guarded_save_is_incremental_too(tmp_path):
    base = _frozen()
    adapter = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(adapter.parameters(), lr=0.1, momentum=0.9)

    def state(step):
        return {"model": {"base": base, **adapter.state_dict()}, "optim": opt.state_dict(), "step": step}

    want = {}
    with _engine(tmp_path) as engine, engine.guard(opt):
        for step in (1, 2, 3):
            adapter(torch.ones(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            engine.save(state(step), step=step)
            want[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in adapter.state_dict().items()}
        engine.wait()
        for step in (1, 2, 3):
            got = engine.load(step=step)
            assert_state_equal(got["model"], {"base": base, **want[step]})
    assert _shard_bytes(tmp_path, 3) < 64 * 1024 and _manifest(tmp_path, 3).depends_on() == {1}


def test_a_run_resumed_from_an_older_step_references_what_it_resumed_from(tmp_path):
    base = _frozen()
    with _engine(tmp_path) as engine:
        for step in (1, 2, 3, 4):
            engine.save(_state(step, base), step=step).wait()
    changed = base.clone()
    changed[0] = -1.0
    with _engine(tmp_path) as engine:
        engine.load(step=2)
        engine.save(_state(3, changed), step=3).wait()  # sets 3 and 4 aside
        engine.save(_state(4, changed), step=4).wait()
        assert [c.step for c in engine.list()] == [1, 2, 3, 4]
        assert_state_equal(engine.load(step=4), _state(4, changed))
        assert_state_equal(engine.load(step=2), _state(2, base))
    assert _manifest(tmp_path, 4).depends_on() == {1, 3}  # the encoder from 1, the changed base from 3


@pytest.mark.parametrize("change, match", [
    (lambda r: r.pop("hash"), "without the hash"),
    (lambda r: r.update(step=9), "not an older checkpoint"),
    (lambda r: r.update(hash="xyz"), "not 32 hex digits"),
    (lambda r: r.update(file="../../etc/passwd"), "not an older checkpoint's shard"),
])
def test_a_crafted_reference_is_corrupt(tmp_path, change, match):
    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    body = _body(tmp_path, 2)
    change(next(r for r in body["tensors"] if "step" in r))
    body["step"] = 5
    with pytest.raises(CorruptCheckpointError, match=match):
        Manifest.from_bytes(_signed(body), where="m")


def _body(root: Path, step: int) -> dict:
    raw = (_ckpt(root, step) / "manifest.json").read_bytes()
    return json.loads(raw.rsplit(b',"manifest_crc32c"', 1)[0] + b"}")


def _signed(body: dict) -> bytes:
    import crc32c

    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw[:-1] + f',"manifest_crc32c":{crc32c.crc32c(raw)}}}'.encode()


def test_a_version_5_manifest_naming_a_step_is_corrupt(tmp_path):
    base = _frozen()
    with _engine(tmp_path) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    body = _body(tmp_path, 2)
    body["version"] = 5
    with pytest.raises(CorruptCheckpointError, match="version 6 on, this manifest is 5"):
        Manifest.from_bytes(_signed(body), where="m")


def test_persist_rm_and_gc_refuse_to_remove_a_referenced_checkpoint_naming_its_dependents(tmp_path):
    from click.testing import CliRunner

    from persist_core.cli import main

    base = _frozen()
    with _engine(tmp_path, full_every=3) as engine:
        for step in (1, 2, 3, 4, 5):  # 1 full, 2 and 3 -> 1, 4 full, 5 -> 4
            engine.save(_state(step, base), step=step).wait()
    refused = CliRunner().invoke(main, ["rm", str(tmp_path), "--step", "1"])
    assert refused.exit_code != 0 and "step 1 by step(s) [2, 3]" in refused.output
    assert CliRunner().invoke(main, ["rm", str(tmp_path), "--step", "1", "--step", "2", "--step", "3"]).exit_code == 0
    gc = CliRunner().invoke(main, ["gc", str(tmp_path), "--keep-last", "1", "--json"])
    assert gc.exit_code == 0, gc.output
    report = json.loads(gc.output)
    assert report["removed"] == [] and {"step": 4, "why": "referenced by step(s) [5] (incremental checkpoints)"} in \
        report["kept"]
    assert_state_equal(CheckpointReader(tmp_path).load(), _state(5, base))


def test_what_a_set_aside_branch_references_is_kept(tmp_path):
    base = _frozen()
    with _engine(tmp_path, keep_local=KeepLastN(1)) as engine:
        for step in (1, 2, 3):  # 2 and 3 reference 1
            engine.save(_state(step, base), step=step).wait()
    changed = base.clone()
    changed[0] = -1.0
    with _engine(tmp_path, full_every=2, keep_local=KeepLastN(1)) as engine:
        engine.load(step=1)
        for step in (2, 3, 4):  # replaces 2, sets the old 3 aside; full_every=2: 2 -> 1 (the encoder), 3 full, 4 -> 3
            engine.save(_state(step, changed), step=step).wait()
        assert _manifest(tmp_path, 4).depends_on() == {3}
        assert [c.step for c in engine.list()] == [1, 3, 4]  # 1 only because the set-aside 3 references it
        aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("abandoned-"))
        assert len(aside) == 1


def test_persist_export_follows_references(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from persist_core.cli import main

    base = _frozen()
    with _engine(tmp_path / "ckpt") as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
    out = tmp_path / "model.safetensors"
    done = CliRunner().invoke(main, ["export", str(tmp_path / "ckpt"), "--step", "2", "--format", "safetensors",
                                     "--to", str(out)])
    assert done.exit_code == 0, done.output
    got = load_file(str(out))
    assert got["model/base.weight"].equal(base) and got["model/encoder"].equal(_state(2, base)["model"]["encoder"])
    assert got["model/adapter"].equal(_state(2, base)["model"]["adapter"])
