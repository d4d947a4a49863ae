"""Incremental saves with a memory tier (issue 42, point 7; issue 43): each snapshot in memory is whole; the disk
saves, written from the same slots, reference what did not change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader, EveryNSteps, MemoryTier
from persist_core.format.manifest import Manifest
from tests.support.states import assert_state_equal

BASE = 1 << 19  # float32 elements of the frozen base: 2 MiB


def _state(step: int, base: torch.Tensor) -> dict:
    adapter = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    return {"model": {"base.weight": base, "tied": base[:8], "adapter": adapter},
            "optim": {"exp_avg": adapter * 0.1, "lr": 1e-3}, "step": step}


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def _clone(state: dict) -> dict:
    return {k: _clone(v) if isinstance(v, dict) else v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


@pytest.mark.parametrize("guarded", [False, True])
def test_snapshots_stay_whole_while_the_disk_saves_from_the_same_slots_reference_the_base(tmp_path, guarded):
    base = torch.randn(BASE, generator=torch.Generator().manual_seed(1234))
    memory = MemoryTier(every_n_steps=1, memory_dir=tmp_path / "shm")
    local = tmp_path / "ckpt"
    engine = CheckpointEngine(local, incremental=True, memory=memory, save_policy=EveryNSteps(2))
    adapter = torch.nn.Parameter(torch.zeros(64, 16))
    opt = torch.optim.SGD([adapter], lr=1.0)
    if guarded:  # a disk save copies the adapter in the background; the next update waits for that copy
        engine.guard(opt)
    saved = {}
    for step in range(1, 7):
        adapter.grad = adapter.detach() - torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
        opt.step()
        state = {"model": {"base.weight": base, "tied": base[:8], "adapter": adapter}, "step": step}
        saved[step] = _clone(state)
        engine.maybe_save(lambda: state, step)
    engine.wait()
    engine.close(keep_memory=True)  # killed after step 6, a step saved to disk too

    # the disk: step 2 full, 4 and 6 reference its base (their shards hold the adapter only)
    manifests = {s: Manifest.from_bytes((_ckpt(local, s) / "manifest.json").read_bytes(), where="m") for s in (2, 4, 6)}
    assert not manifests[2].depends_on() and manifests[4].depends_on() == {2} and manifests[6].depends_on() == {2}
    own = sum(f.stat().st_size for f in _ckpt(local, 6).iterdir() if f.name != "manifest.json")
    assert own < BASE, own
    with CheckpointReader(local) as disk:
        for s in (2, 4, 6):
            assert_state_equal(disk.load(s), saved[s])

    # memory: the newest snapshot is whole, read with no disk checkpoint it could lean on: step 6's slot, which the
    # referencing disk save was written from (guarded, once the deferred copy of the adapter was made)
    for s in (2, 4, 6):
        shutil.rmtree(_ckpt(local, s))
    with CheckpointReader(local, memory=memory) as reader:
        got = reader.load()
        assert reader.loaded_step == 6
    assert_state_equal(got, saved[6])


def test_a_restart_from_memory_goes_on_referencing_the_disk_checkpoints(tmp_path):
    base = torch.randn(BASE, generator=torch.Generator().manual_seed(99))
    memory = MemoryTier(every_n_steps=1, memory_dir=tmp_path / "shm")
    local = tmp_path / "ckpt"
    first = CheckpointEngine(local, incremental=True, memory=memory, save_policy=EveryNSteps(3))
    for step in range(1, 5):
        first.maybe_save(lambda: _state(step, base), step)
    first.wait()
    first.close(keep_memory=True)
    second = CheckpointEngine(local, incremental=True, memory=memory, save_policy=EveryNSteps(3))
    assert second.load()["step"] == 4  # from memory
    for step in range(5, 7):
        second.maybe_save(lambda: _state(step, base), step)
    second.close()
    m6 = Manifest.from_bytes((_ckpt(local, 6) / "manifest.json").read_bytes(), where="m")
    assert m6.depends_on() == {3}
    with CheckpointReader(local) as disk:
        assert_state_equal(disk.load(6), _state(6, base))
