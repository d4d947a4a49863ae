"""Sharded leaves and resharded loads in one process: a 1-rank gloo group and its DTensors, plain targets."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from persist_core import CheckpointEngine, CheckpointReader, CorruptCheckpointError, PerRank, UnsupportedStateError
from persist_core.format.tree import flatten
from persist_core.assembly.plan import overlap
from persist_core.planning.sharding import replica_digests
from tests.support.states import assert_state_equal


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()  # an earlier in-process test (a Trainer, an Accelerator) may have made one
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def test_a_partial_dtensor_is_refused_naming_it_and_the_fix(tmp_path, mesh):
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with CheckpointEngine(tmp_path) as engine:
        with pytest.raises(UnsupportedStateError, match=r"state\['g'\].*Partial.*redistribute"):
            engine.save({"g": partial}, step=1)
        assert engine.list() == []


def test_a_dtensor_round_trips_whole_and_into_targets_with_per_rank_values(tmp_path, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(35.0).reshape(7, 5)
    with CheckpointEngine(tmp_path) as engine:
        engine.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "rng": PerRank(torch.tensor([3])), "n": 1},
                    step=1).wait()
        whole = engine.load()
        assert_state_equal(whole, {"w": full, "rng": torch.tensor([3]), "n": 1})
        target = distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)])
        state = engine.load(into={"w": target})
        assert state["w"] is target and torch.equal(target.full_tensor(), full)


def test_a_local_copy_that_fails_verification_is_read_from_the_remote_in_ranges(tmp_path, caplog):
    remote = f"file://{tmp_path / 'remote'}"
    w = torch.randn(512, 1024)
    with CheckpointEngine(tmp_path / "ckpt", remote_url=remote) as engine:
        engine.save({"w": w, "b": torch.ones(3)}, step=1).wait()
    shard = tmp_path / "ckpt" / "step-000000000001" / "rank-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-(1 << 20)] ^= 0xFF  # inside w's bytes
    shard.write_bytes(bytes(raw))
    with CheckpointReader(tmp_path / "ckpt") as local_only:
        with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
            local_only.load(1, into={"w": torch.zeros(512, 1024)})
    with CheckpointReader(tmp_path / "ckpt", remote_url=remote) as reader:
        state = reader.load(1, into={"w": torch.zeros(512, 1024)})
        assert torch.equal(state["w"], w) and torch.equal(state["b"], torch.ones(3))
        assert reader.loaded_from_remote
    assert "local copy does not verify" in caplog.text


def test_overlap_of_boxes():
    assert overlap(((0, 0), (4, 5)), ((2, 3), (4, 4))) == ((2, 3), (2, 2))
    assert overlap(((0,), (4,)), ((4,), (3,))) is None


def test_replica_digests_catch_one_changed_element_fully_and_sampled_ones_are_cheap():
    a = flatten({"w": torch.zeros(1000), "v": torch.ones(3, 4)})
    b = flatten({"w": torch.zeros(1000).index_fill_(0, torch.tensor([517]), 1.0), "v": torch.ones(3, 4)})
    full_a, full_b = (replica_digests(f, {}, mode="full", seed=0) for f in (a, b))
    assert full_a[0] != full_b[0] and full_a[1] == full_b[1]
    assert replica_digests(a, {}, mode="off", seed=0) == [None, None]
    assert replica_digests(a, {}, mode="sampled", seed=5) == replica_digests(a, {}, mode="sampled", seed=5)


def test_export_safetensors_from_a_remote_streams_every_tensor_and_leaves_nothing_on_failure(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from persist_core.cli import main

    remote = f"file://{tmp_path / 'remote'}"
    state = {"model": {"w": torch.randn(300, 700), "b": torch.arange(5)}, "lr": 0.5, "opaque": object.__name__}
    with CheckpointEngine(tmp_path / "ckpt", remote_url=remote) as engine:
        engine.save(state, step=3).wait()
    out = tmp_path / "m.safetensors"
    result = CliRunner().invoke(main, ["export", remote, "--format", "safetensors", "--to", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 tensors, " in result.output and " MB/s)" in result.output  # what it wrote, and how fast
    exported = load_file(out)
    assert torch.equal(exported["model/w"], state["model"]["w"]) and torch.equal(exported["model/b"], state["model"]["b"])
    shard = tmp_path / "remote" / "step-000000000003" / "rank-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    again = CliRunner().invoke(main, ["export", remote, "--format", "safetensors", "--to", str(tmp_path / "n.st")])
    assert again.exit_code != 0 and "does not match its checksum" in again.output
    assert sorted(p.name for p in tmp_path.iterdir() if "n.st" in p.name) == []
