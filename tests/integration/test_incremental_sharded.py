"""Incremental saves of sharded state (issue 43): an FSDP2 model on two gloo ranks with a frozen base; the shards of
the frozen base are written at the full save only, later saves reference them, and every save loads bit-exact,
whole in one process and into fresh FSDP2 targets."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from click.testing import CliRunner
from safetensors.torch import load_file

from persist_core import CheckpointReader
from persist_core.cli import main
from persist_core.format.manifest import Manifest
from tests.integration.test_multirank import free_port
from tests.support.incremental_sharded_child import run


def test_fsdp2_shards_of_a_frozen_base_are_referenced_and_every_save_loads_bit_exact(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(run, args=(2, free_port(), str(root), str(out)), nprocs=2, join=True)
    result = torch.load(out / "rank0.pt")
    assert result["into_equal"] and torch.load(out / "rank1.pt")["into_equal"]  # each rank's into= load
    manifests = {s: Manifest.from_bytes((root / f"step-{s:012d}" / "manifest.json").read_bytes(), where="m")
                 for s in (1, 2, 3)}
    assert not manifests[1].depends_on() and manifests[2].depends_on() == {1} and manifests[3].depends_on() == {1}
    full = sum(f.size for f in manifests[1].files)
    later = sum(f.size for f in manifests[3].files)
    assert full > 4 * 256 * 256 * 4 and later < full / 10, (full, later)
    with CheckpointReader(root) as reader:
        for s in (1, 2, 3):
            model = reader.load(s)["model"]
            for k, v in result["saved"][s].items():
                assert torch.equal(model[k], v), (s, k)
    with CheckpointReader(tmp_path / "fresh", remote_url=(out / "remote").as_uri()) as fresh:  # a fresh machine
        assert [c.step for c in fresh.list("remote")] == [1, 2, 3]
        model = fresh.load(3)["model"]
        assert all(torch.equal(model[k], v) for k, v in result["saved"][3].items())
    uploaded = sum(p.stat().st_size for p in (out / "remote" / "step-000000000003").iterdir())
    assert uploaded < full / 10, uploaded  # the remote got the changed chunks only
    exported = tmp_path / "step3.safetensors"  # persist verify and export follow the chunks' references
    for args in (["verify", str(root)], ["export", str(root), "--step", "3", "--format", "safetensors", "--to", str(exported)]):
        done = CliRunner().invoke(main, args)
        assert done.exit_code == 0, done.output
    whole = load_file(exported)
    assert any(torch.equal(t, result["saved"][3]["0.0.weight"]) for t in whole.values())
