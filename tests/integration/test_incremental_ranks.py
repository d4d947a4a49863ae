"""Incremental saves with several ranks (issue 43): two gloo ranks each write part of a replicated (DDP-like)
state; what did not change is referenced, whichever rank's file of the older checkpoint holds it."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from persist_core import CheckpointReader
from persist_core.format.manifest import Manifest
from tests.integration.test_multirank import free_port
from tests.support.incremental_ranks_child import ddp_state, run
from tests.support.states import assert_state_equal


def test_two_ranks_reference_the_frozen_base_and_every_kept_checkpoint_loads_bit_exact(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(run, args=(2, free_port(), str(root), str(out)), nprocs=2, join=True)
    for r in range(2):
        assert json.loads((out / f"rank{r}.json").read_text()) == {"step": 5, "equal": True}
    with CheckpointReader(root) as reader:
        steps = [c.step for c in reader.list()]
        # full_every=3: 1 full, 2 and 3 reference it, 4 full, 5 references 4; keep_last=2 keeps 4 and 5
        assert steps == [4, 5], steps
        for s in steps:
            assert_state_equal(reader.load(s), ddp_state(s))
    manifest = {s: Manifest.from_bytes((root / f"step-{s:012d}" / "manifest.json").read_bytes(), where="m")
                for s in steps}
    assert not manifest[4].depends_on() and manifest[5].depends_on() == {4}
    assert manifest[5].world_size == 2 and len(manifest[5].files) == 2
    own = {f.name: f.size for f in manifest[5].files}
    full = {f.name: f.size for f in manifest[4].files}
    # both ranks wrote part of the frozen base at step 4; at step 5 neither writes it again
    assert all(full[n] > 200_000 for n in full), full
    assert sum(own.values()) < 40_000, own
