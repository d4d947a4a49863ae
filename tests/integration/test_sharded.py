"""Sharded state (FSDP2 ``fully_shard``, DTensors on 1-D and 2-D meshes): each rank writes its own part, and
jobs of another size load it resharded — real gloo process groups on CPU meshes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from persist_core import CheckpointEngine, CheckpointReader, ConfigError
from tests.support import sharded_child
from tests.support.states import assert_state_equal


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, _port(), *args), nprocs=world, join=True)


def _results(out: Path, kind: str, world: int) -> list[dict]:
    return [torch.load(out / f"{kind}-rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture
def out(tmp_path):
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> tuple[Path, str, Path]:
    """``(root, remote, out)``: an FSDP2 state saved sharded by two ranks (:func:`sharded_child.save`, with a
    file:// remote), which the tests below only read: one start of the two ranks for them all (each imports torch)."""
    base = tmp_path_factory.mktemp("saved-on-two")
    root, remote, out = base / "ckpt", f"file://{base / 'remote'}", base / "out"
    out.mkdir()
    _spawn(sharded_child.save, 2, str(root), remote, str(out), False)
    return root, remote, out


def test_fsdp2_on_two_ranks_loads_bit_exact_on_three_from_the_remote_and_whole_on_one(tmp_path, out, saved_on_two):
    root, remote, saved_out = saved_on_two
    saved = _results(saved_out, "save", 2)
    full = saved[0]["full"]
    # each rank wrote its own part: about half the bytes each, one file per rank, chunks in the manifest
    manifest = json.loads((root / "step-000000000002" / "manifest.json").read_text())
    assert manifest["version"] == 7 and manifest["world_size"] == 2
    weight = next(t for t, p in zip(manifest["tensors"], _paths(manifest)) if p == "model/0.weight")
    assert weight["shape"] == [7, 5] and sorted(c["offsets"][0] for c in weight["chunks"]) == [0, 4]
    assert {c["file"] for c in weight["chunks"]} == {"rank-00000.safetensors", "rank-00001.safetensors"}
    # the .to_local() workaround (equal shapes, other values per rank) is refused, naming tensor and ranks
    for r in range(2):
        assert "state['model/w']" in saved[r]["mixed"] and "ranks [1]" in saved[r]["mixed"], saved[r]["mixed"]
        assert "PerRank" in saved[r]["mixed"]
    assert not (root / "step-000000000003").exists()

    # one process, no target: whole tensors (consolidation), Adam moments and step included
    with CheckpointReader(root) as reader:
        whole = reader.load()
    assert_state_equal(dict(whole["model"]), dict(full["model"]))
    assert_state_equal(whole["optim"]["state"], full["optim"]["state"])
    assert torch.equal(whole["rng"], torch.tensor([0]))  # rank 0's PerRank value in one process

    # one process with plain targets (2 -> 1 through into=): filled in place
    targets = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()}}
    with CheckpointReader(root) as reader:
        state = reader.load(into=targets)
        stats = reader.last_load
    assert all(state["model"][k] is targets["model"][k] for k in targets["model"])
    assert_state_equal(targets["model"], full["model"])
    assert stats.read_bytes >= stats.needed_bytes > 0

    # three ranks on a fresh machine (empty local_dir): ranged reads from the remote, resharded 2 -> 3
    _spawn(sharded_child.load, 3, str(tmp_path / "fresh"), remote, str(out), False, "")
    loaded = _results(out, "load", 3)
    gathered = loaded[0]["full"]  # rank 0 gathers every rank's part of the loaded model and optimizer
    assert_state_equal(dict(gathered["model"]), dict(full["model"]))
    assert_state_equal(gathered["optim"]["state"], full["optim"]["state"])
    for r, res in enumerate(loaded):
        assert res["step"] == 2 and res["same_objects"]
        assert (res["rng"] is None) if r == 2 else torch.equal(res["rng"], torch.tensor([r * 10]))
    assert not (tmp_path / "fresh" / "step-000000000002").exists()  # read in ranges, never downloaded whole


def test_four_ranks_on_a_2d_mesh_load_on_two_and_one_process_checkpoint_loads_into_two(tmp_path, out):
    root = tmp_path / "ckpt"
    plain_root = tmp_path / "plain"
    one = sharded_child.model(5)
    with CheckpointEngine(plain_root) as engine:
        engine.save({"model": one.state_dict()}, step=1).wait()
    _spawn(sharded_child.save, 4, str(root), "", str(out), True)
    full = _results(out, "save", 4)[0]["full"]
    manifest = json.loads((root / "step-000000000002" / "manifest.json").read_text())
    grid_b = next(t for t, p in zip(manifest["tensors"], _paths(manifest)) if p == "grid/b")
    # Replicate() over dp: the two replicas of each tp part split it, so all four ranks write a piece of it
    assert sorted((c["offsets"][0], c["sizes"][0]) for c in grid_b["chunks"]) == [(0, 2), (2, 2), (4, 1), (5, 2)]
    assert len({c["file"] for c in grid_b["chunks"]}) == 4
    _spawn(sharded_child.load, 2, str(root), "", str(out), True, str(plain_root))
    loaded = _results(out, "load", 2)
    assert_state_equal(dict(loaded[0]["full"]["model"]), dict(full["model"]))
    assert_state_equal(loaded[0]["full"]["optim"]["state"], full["optim"]["state"])
    for res in loaded:
        assert_state_equal(res["grid"], sharded_child.two_d())
        assert_state_equal(res["from_one"], dict(one.state_dict()))
        needed, read = res["stats"]
        assert needed <= read <= 1.2 * needed + 3 * (1 << 20)


def test_a_target_of_another_shape_is_refused_naming_it(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        engine.save({"w": torch.ones(4, 3)}, step=1).wait()
        with pytest.raises(ConfigError, match=r"into\['w'\] has shape \[3, 4\].*saved \[4, 3\]"):
            engine.load(into={"w": torch.zeros(3, 4)})
        with pytest.raises(ConfigError, match="does not hold"):
            engine.load(into={"v": torch.zeros(4, 3)})


def _paths(manifest: dict) -> list[str]:
    from persist_core.format.tree import tensor_paths

    return tensor_paths(manifest["tree"])


def test_inspect_shows_global_shapes_and_placements_and_export_makes_them_whole(tmp_path, saved_on_two):
    from click.testing import CliRunner

    from persist_core.cli import main

    root, _, out = saved_on_two
    result = CliRunner().invoke(main, ["inspect", str(root), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)["entries"]}
    assert rows["model/0.weight"]["shape"] == [7, 5] and rows["model/0.weight"]["sharded"]
    assert rows["model/0.weight"]["placements"] == "(Shard(dim=0),)" and rows["model/0.weight"]["mesh"] == [2]
    assert rows["optim/state/0.weight/exp_avg"]["shape"] == [7, 5]
    assert rows["rng"]["dtype"] == "per-rank"
    table = CliRunner().invoke(main, ["inspect", str(root)], env={"COLUMNS": "240"})
    assert "sharded (Shard(dim=0),) on mesh (2,): 2 part(s)" in table.output

    # export --format safetensors: every tensor whole (consolidated), streamed tensor by tensor
    from safetensors.torch import load_file

    full = _results(out, "save", 2)[0]["full"]
    result = CliRunner().invoke(main, ["export", str(root), "--format", "safetensors", "--to", str(tmp_path / "m.st")])
    assert result.exit_code == 0, result.output
    assert "not tensors, so not in it: rng" in result.output
    exported = load_file(tmp_path / "m.st")
    assert_state_equal({k.removeprefix("model/"): v for k, v in exported.items() if k.startswith("model/")},
                       dict(full["model"]))
    assert torch.equal(exported["optim/state/2.weight/exp_avg_sq"], full["optim"]["state"]["2.weight"]["exp_avg_sq"])


def test_the_accelerate_hooks_fsdp2_path_saves_sharded_and_restores_on_another_world_size(tmp_path, out):
    root = tmp_path / "ckpt"
    _spawn(sharded_child.accelerate_round_trip, 2, str(root), str(out), "save")
    saved = _results(out, "save", 2)[0]["full"]
    manifest = json.loads((root / "step-000000000002" / "manifest.json").read_text())
    assert any("chunks" in t for t in manifest["tensors"])  # sharded, not gathered
    _spawn(sharded_child.accelerate_round_trip, 3, str(root), str(out), "load")
    restored = _results(out, "load", 3)[0]["full"]
    assert_state_equal(dict(restored["model"]), dict(saved["model"]))
    assert_state_equal(restored["optim"]["state"], saved["optim"]["state"])


def test_sigkill_of_one_rank_mid_write_commits_nothing_and_the_other_rank_does_not_hang(tmp_path, out):
    from tests.support.ranks import exit_codes

    root = tmp_path / "ckpt"
    assert exit_codes(sharded_child.kill_mid_write, 2, str(root), str(out)) == [0, -9]
    outcome = torch.load(out / "kill-rank0.pt")["outcome"]
    assert outcome.startswith("PersistError: checkpoint step=2 was not committed") and "another rank died" in outcome
    with CheckpointReader(root) as reader:
        assert [c.step for c in reader.list()] == [1]
        state = reader.load()
    assert set(state) == {"model", "optim"}
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [] or all(not (root / name / "manifest.json").exists() for name in leftovers)
